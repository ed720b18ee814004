"""`analyze` and `report` on the committed localize run: its section counts, per layer and
per component, the divergent rows whose donor a transplant recovers, as the CSV says.

Works on a copy of results/localize-smollm2 in tmp_path: committed results are never
written."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
from helpers import invoke

RUN = Path(__file__).resolve().parents[2] / "results" / "localize-smollm2"
DIRECTION = "incremental_cache_into_prefill"
pytestmark = pytest.mark.skipif(not (RUN / "rows.jsonl").is_file(), reason=f"{RUN} is absent")


@pytest.fixture(scope="module")
def analysed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The committed run, analysed in a temporary folder, with analyze's output."""
    run = tmp_path_factory.mktemp("localize") / RUN.name
    shutil.copytree(RUN, run)
    result = invoke("analyze", run)
    assert result.exit_code == 0, result.output
    return run, result.output


def _recovered(probes: list[dict[str, str]], **where: str) -> int:
    chosen = [p for p in probes if all(p[k] == v for k, v in where.items())]
    assert chosen, where
    return sum(p["recovers_donor"] == "true" for p in chosen)


def test_claims_count_each_layer_and_component_as_the_csv_does(
    analysed: tuple[Path, str],
) -> None:
    run, _ = analysed
    section = json.loads((run / "claims.json").read_text(encoding="utf-8"))["localize"]
    with (RUN / "localize.csv").open(newline="", encoding="utf-8") as handle:
        probes = list(csv.DictReader(handle))
    layers = int(probes[0]["num_layers"])
    assert (section["precision"], section["num_layers"], section["rows"]) == ("bf16", layers, 2)
    assert list(section["directions"]) == [DIRECTION]
    d = section["directions"][DIRECTION]
    assert [p["layer"] for p in d["single"]] == list(range(layers))
    assert [p["layers"] for p in d["prefix"]] == list(range(1, layers + 1))
    assert [p["from_layer"] for p in d["suffix"]] == list(range(layers))
    assert {p["probed"] for p in d["single"] + d["prefix"] + d["suffix"]} == {2}
    for i in range(layers):
        assert d["single"][i]["recovered"] == _recovered(probes, sweep="single", layers=str(i))
        below = "0" if i == 0 else f"0-{i}"
        assert d["prefix"][i]["recovered"] == _recovered(probes, sweep="prefix", layers=below)
        above = str(i) if i == layers - 1 else f"{i}-{layers - 1}"
        assert d["suffix"][i]["recovered"] == _recovered(probes, sweep="suffix", layers=above)
    for name, component in (("keys_only", "k"), ("values_only", "v")):
        expected = _recovered(probes, sweep="component", component=component)
        assert d[name] == {"recovered": expected, "probed": 2}
    minimal = {p["row_id"]: p["layers"] for p in probes if p["sweep"] == "minimal"}
    assert d["minimal_windows"] == minimal


def test_analyze_prints_a_line_per_direction(analysed: tuple[Path, str]) -> None:
    _, output = analysed
    (line,) = [line for line in output.splitlines() if line.startswith("localize ")]
    assert line.startswith(f"localize bf16 {DIRECTION}: all 30 layers recover the donor on ")


def test_report_tabulates_each_layer_and_draws_the_runs_figure(
    analysed: tuple[Path, str], tmp_path: Path
) -> None:
    run, _ = analysed
    result = invoke("report", run, "-o", tmp_path)
    assert result.exit_code == 0, result.output
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "## Localize: which layers carry a divergent trajectory?" in markdown
    assert "| direction | layer i | alone | layers [0, i+1) | layers [i, L) |" in markdown
    assert f"| {DIRECTION} | 29 |" in markdown
    assert "(figures/localize.png)" in markdown
    # the report draws the figure the experiment drew after its run, byte for byte
    committed = (RUN / "figures" / "localize.png").read_bytes()
    assert (tmp_path / "figures" / "localize.png").read_bytes() == committed
