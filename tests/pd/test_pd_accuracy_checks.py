"""`hybridkv bench pd-accuracy`'s verdicts without processes: what fails a cell, and that any failing cell makes
the command exit 1 (its sweep replaced by one that returns prepared results)."""

from __future__ import annotations

import dataclasses

import pytest
from typer.testing import CliRunner

from hybridkv.cli import app
from hybridkv.pd_accuracy.checks import CellResult, Completion, exit_code, logprobs_close, problems
from hybridkv.pd_accuracy.grid import Cell, SweepOptions, cells

CELL = Cell("embedded", "mixed", "1P2D", "proxy")
TEXTS = tuple(Completion(f" {i}{i}\n", (-0.25 * i - 1e-4, -0.647037208)) for i in range(8))
PASSING = CellResult(
    CELL,
    score=0.75,
    single_score=0.75,
    outputs=TEXTS,
    expected=TEXTS,
    greedy_reads=(4, 4),
    reads=(9, 11),
    prefill_tokens=(1234,),
)


def test_a_cell_that_equals_the_single_instance_and_read_kv_passes():
    assert problems(PASSING) == [] and exit_code([PASSING, PASSING]) == 0


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (dict(score=0.6875), "lm-eval score 0.6875 != single instance 0.75"),
        (dict(outputs=(*TEXTS[:7], Completion(" 99\n", TEXTS[7].logprobs))), "greedy outputs equal for 7/8 prompts"),
        (
            dict(outputs=(*TEXTS[:7], Completion(TEXTS[7].text, (-1.76, -0.6476)))),
            "logprobs within tolerance for 7/8",
        ),
        (dict(outputs=TEXTS[:7]), "greedy outputs equal for 7/8 prompts"),
        (dict(greedy_reads=(4, 3)), "7 KV reads for 8 greedy prompts"),
        (dict(reads=(20, 0)), "decoder 1 read no KV"),
        (dict(failures=2), "2 failed KV reads"),
        (dict(prefill_tokens=(0,)), "prefill instance 0 took no prompt"),
        (dict(leftovers=("http://x: 3 blocks held, integrity 'ok'",)), "3 blocks held"),
        (dict(error="RuntimeError: server exited"), "server exited"),
    ],
)
def test_each_difference_fails_the_cell_and_the_sweep(change, reason):
    failing = dataclasses.replace(PASSING, **change)
    assert any(reason in p for p in problems(failing)), problems(failing)
    assert exit_code([PASSING, failing]) == 1


def fake_sweep(wrong_last: bool):
    """A sweep whose every cell passes, but for the last one's 3rd greedy output if `wrong_last`."""

    def run(options: SweepOptions, report) -> list[CellResult]:
        out = []
        for c in cells(options):
            report(str(c), True)
            out.append(dataclasses.replace(PASSING, cell=c, greedy_reads=(8,), reads=(20,), prefill_tokens=(9, 9)))
        if wrong_last:
            out[-1] = dataclasses.replace(out[-1], outputs=(*TEXTS[:2], Completion("wrong"), *TEXTS[3:]))
        return out

    return run


def test_the_command_exits_1_and_names_the_cell_when_one_greedy_output_differs(monkeypatch):
    import hybridkv.cli.bench_pd_accuracy as command
    import hybridkv.pd_accuracy.sweep as sweep

    monkeypatch.setattr(command, "_check_dependencies", lambda options: None)
    args = ["bench", "pd-accuracy", "--models", "embedded", "--layouts", "packed", "--topologies", "1P1D,2P1D"]
    monkeypatch.setattr(sweep, "run_sweep", fake_sweep(wrong_last=True))
    r = CliRunner().invoke(app, [*args, "--routers", "proxy"])
    assert r.exit_code == 1, r.output
    assert "FAIL embedded packed 2P1D proxy: greedy outputs equal for 7/8 prompts" in r.output
    assert "1/2 cells pass" in r.output
    monkeypatch.setattr(sweep, "run_sweep", fake_sweep(wrong_last=False))
    r = CliRunner().invoke(app, [*args, "--routers", "proxy"])
    assert r.exit_code == 0 and "2/2 cells pass" in r.output, r.output


def test_logprobs_pass_float_noise_and_fail_a_corrupted_prompt():
    single = Completion(" 659\n", (-0.00035458477, -0.6470372080802917, -3.71149e-4))
    noise = Completion(" 659\n", (-0.00035470392, -0.64703768491745, -3.71149e-4))  # both seen through PD
    skipped_block = Completion(" 659\n", (-0.00035458477, -0.6470372080802917, -2.96787e-4))  # the decoder's
    assert logprobs_close(single, noise)  # logprob when it skipped the first block of the read
    assert not logprobs_close(single, skipped_block)
    assert not logprobs_close(single, Completion(" 659\n", single.logprobs[:2]))


def test_an_unknown_axis_value_is_a_clear_usage_error():
    r = CliRunner().invoke(app, ["bench", "pd-accuracy", "--layouts", "packed,diagonal"])
    assert r.exit_code == 2 and "unknown layout diagonal" in r.output
