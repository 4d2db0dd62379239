"""The command line and the PD proxy start without torch: `hybridkv --help` answers at once, and a proxy host (it
only routes HTTP) needs neither torch nor the engine's memory. Each check runs in a fresh interpreter, since this
one has torch loaded already."""

import subprocess
import sys

import pytest

HEAVY = ("torch", "hybridkv.engine.engine", "hybridkv.connectors.offload.connector")
PROGRAM = """
import sys
import {module}
print(",".join(m for m in {heavy} if m in sys.modules))
"""


@pytest.mark.parametrize("module", ["hybridkv.cli", "hybridkv.serve.proxy", "hybridkv.connectors.pd.transfer_params"])
def test_loads_no_torch_and_no_engine(module):
    program = PROGRAM.format(module=module, heavy=HEAVY)
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "", f"importing {module} loaded {out.stdout.strip()}"


def test_a_connector_is_loaded_when_a_config_names_it():
    """Connectors register themselves when their module loads, which the registry does on first use."""
    program = (
        "import sys\n"
        "from hybridkv.connectors.base import connector_factory\n"
        "assert 'hybridkv.connectors.offload.connector' not in sys.modules\n"
        "print(connector_factory('OffloadingConnector').__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "OffloadingConnector"


def test_an_unknown_connector_is_refused_with_the_known_ones():
    from hybridkv.connectors.base import KVTransferConfig

    with pytest.raises(ValueError, match="'NixlConector' is unknown; known: NixlConnector, OffloadingConnector"):
        KVTransferConfig("NixlConector")
