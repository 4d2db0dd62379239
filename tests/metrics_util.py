"""Read /metrics as a scraper does: through prometheus_client's text parser."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

ENGINE_LABELS = frozenset(("model_name", "engine"))  # on every engine sample (vLLM's convention)


def parse(text: str) -> dict[str, float]:
    """Sample name -> value; labels other than model_name and engine stay in the key: 'name{group="0"}'."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            extra = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k not in ENGINE_LABELS)
            out[f"{s.name}{{{extra}}}" if extra else s.name] = s.value
    return out


def scrape(url: str, **kw) -> dict[str, float]:
    r = httpx.get(f"{url}/metrics", timeout=10, **kw)
    r.raise_for_status()
    return parse(r.text)
