"""The http backend's server adapters as registered (one module per server), the
probe's refusal, which names the adapter's own remedy, and what a report says ran a
served run's rows."""

from __future__ import annotations

from kvreplay.backends import backend_class
from kvreplay.backends.http import ADAPTERS, adapter_class
from kvreplay.backends.http.server import Probe

PROTOCOL = ("recognises", "probe", "reset", "round_trip", "tokenize", "complete")


def test_every_registered_adapter_loads_under_its_name_and_speaks_the_protocol() -> None:
    assert ADAPTERS.names() == ["vllm", "llamacpp"]
    for name, cls in ADAPTERS.items():
        assert adapter_class(name) is cls and cls.name == name
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


def test_a_report_names_the_server_build_or_the_library_that_ran_the_rows() -> None:
    served = {"server": "llamacpp", "identity": {"version": "b1-0c1e570"}}
    assert backend_class("http").version(served, {}) == "llamacpp server b1-0c1e570"
    assert backend_class("llamacpp").version({}, {"llama_cpp_python": "0.3.36"}) == "0.3.36"
    assert backend_class("vllm").version({}, {"vllm": "0.32.0", "torch": "2.13.0"}) == "0.32.0"
    assert backend_class("llamacpp").version({}, {"torch": "2.13.0"}) == "?"
