"""The http backend's server adapters as registered (one module per server) and the
probe's refusal, which names the adapter's own remedy."""

from __future__ import annotations

from kvreplay.backends.http import ADAPTERS, adapter_class
from kvreplay.backends.server import Probe

PROTOCOL = ("recognises", "probe", "reset", "round_trip", "tokenize", "complete")


def test_every_registered_adapter_loads_under_its_name_and_speaks_the_protocol() -> None:
    assert set(ADAPTERS) == {"vllm", "llamacpp"}
    for name, where in ADAPTERS.items():
        cls = adapter_class(name)
        assert cls.name == name
        assert cls.__module__ == where.partition(":")[0]
        assert all(callable(getattr(cls, method, None)) for method in PROTOCOL)


def _probe(**lacks: bool) -> dict:
    given = {"reports_settings": True, "can_reset": True, "reports_cached_tokens": True}
    return {"server": "s", "identity": {}, "tokenizes": True, **given, **lacks}


def test_a_probe_refuses_with_the_remedy_its_adapter_gives_and_none_it_does_not() -> None:
    remedies = {"control": "FLAG_A=1", "cached_tokens": "--flag-b"}
    no_reset = Probe(**_probe(can_reset=False), remedies=remedies).missing("http://h")
    assert no_reset is not None and no_reset.endswith("; start it with FLAG_A=1.")
    no_report = Probe(**_probe(reports_cached_tokens=False), remedies=remedies).missing("x")
    assert no_report is not None and no_report.endswith("; start it with --flag-b.")
    plain = Probe(**_probe(reports_cached_tokens=False)).missing("x")
    assert plain is not None and "start it with" not in plain and plain.endswith("verified.")
    assert Probe(**_probe(), remedies=remedies).missing("x") is None
