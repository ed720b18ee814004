"""Every option and every registered name is declared once (issue 42): the command line's
defaults are the typed requests' own, and a registry refuses a second entry of a name
instead of letting one silently win."""

from __future__ import annotations

from typing import Any

import click
import pytest

from kvreplay.cli import KEEP, backend_options, main, run_group
from kvreplay.core.errors import KvreplayError
from kvreplay.core.options import Declared, arguments, declared, every
from kvreplay.core.registry import Registry, installed_entries
from kvreplay.engines.placement import Placement
from kvreplay.run.check import CHECK_DEFAULTS, CheckRequest
from kvreplay.run.request import RunOptions


def _cli_default(param: click.Parameter, spec: Declared) -> Any:
    """What a click option's default means as the field's value."""
    value = param.default
    if spec.option.parse is not None and isinstance(value, str):
        return spec.option.parse(value)
    return value


def _params(command: click.Command) -> dict[str, click.Parameter]:
    with click.Context(command) as context:
        return {p.name: p for p in command.get_params(context) if p.name}


def _typed_defaults(cls: type, overrides: dict[str, Any]) -> dict[str, tuple[Declared, Any]]:
    return {s.name: (s, overrides.get(s.name, s.default)) for s in every(cls)}


@pytest.mark.parametrize("experiment", sorted(run_group.commands))
def test_every_run_option_defaults_to_its_typed_default(experiment: str) -> None:
    from kvreplay.experiments.registry import EXPERIMENTS

    params = _params(run_group.commands[experiment])
    temperature = EXPERIMENTS.get(experiment).temperature
    for name, (spec, default) in _typed_defaults(RunOptions, {"temperature": temperature}).items():
        if spec.kind == "bool" and spec.option.negative:
            default = None  # a tri-state switch: None means "not given"
        assert _cli_default(params[name], spec) == default, f"{experiment} {spec.flag}"


def test_every_check_option_defaults_to_its_typed_default() -> None:
    params = _params(main.commands["check"])
    for name, (spec, default) in _typed_defaults(CheckRequest, CHECK_DEFAULTS).items():
        if spec.kind == "bool" and spec.option.negative:
            default = None
        assert _cli_default(params[name], spec) == default, spec.flag


def test_every_audit_and_backend_option_is_its_declaration() -> None:
    audit = _params(main.commands["audit"])
    for spec in every(Placement):
        assert audit[spec.name].default == spec.default, spec.flag
        assert audit[spec.name].opts == [spec.flag]
    from kvreplay.backends import setting_options

    offered = {o.name: o for o in backend_options()}
    for key, setting in setting_options().items():
        assert offered[key].opts == [setting.declared.flag]
        # recorded only when given (a flag is off unless given)
        assert offered[key].default in (None, False)


def test_every_demo_option_is_its_declaration() -> None:
    """``kvreplay demo`` writes no option by hand either: each is a field of its request."""
    from kvreplay.demo import DemoRequest

    params = _params(main.commands["demo"])
    offered = sorted(n for n in params if n != "help" and not n.startswith("_"))
    assert offered == sorted(s.name for s in every(DemoRequest))
    for spec in every(DemoRequest):
        assert params[spec.name].opts == [spec.flag]
        assert _cli_default(params[spec.name], spec) == spec.default, spec.flag


def test_the_test_sees_a_cli_default_that_differs() -> None:
    """The check can fail: a click option whose default is not its field's is caught."""
    spec = declared(Placement)["workers"]
    wrong = click.Option(["--workers", "workers"], default=2)
    assert _cli_default(wrong, spec) != spec.default
    assert KEEP is not None


def test_a_request_spells_back_the_options_it_was_given() -> None:
    """A repro pack's command is spelled from the typed request: each option that is not
    its default, with the flag its field declares."""
    request = CheckRequest(n=3, dtypes=("fp32",), placement=Placement(threads=2))
    # the check declares its own --dtypes field (its default is the check's choice)
    assert arguments(request) == ["--dtypes", "fp32", "--n", "3", "--threads", "2"]


def test_a_registry_refuses_two_entries_of_one_name() -> None:
    class Entry:
        def __init__(self, name: str) -> None:
            self.name = name

    registry: Registry[Entry] = Registry(
        "widget", lambda: [("a.first", Entry("x")), ("b.second", Entry("x"))]
    )
    with pytest.raises(KvreplayError, match="Two widgets are named 'x' .a.first and b.second."):
        registry.names()
    single: Registry[Entry] = Registry("widget", lambda: [("a", Entry("x"))])
    assert single.names() == ["x"]
    with pytest.raises(KvreplayError, match="Unknown widget 'y'; choose x."):
        single.get("y")


def test_an_installed_backend_that_reuses_a_builtin_name_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A package registering a backend under a name kvreplay already has is named, not
    silently shadowed (the old registry kept the first)."""
    from kvreplay import backends

    installed_entries.cache_clear()
    monkeypatch.setattr(
        "kvreplay.core.registry.installed_entries",
        lambda group: ("kvreplay.backends.hf:HfBackend",) if group == "kvreplay.backends" else (),
    )
    fresh = Registry("backend", backends.located(backends.BUILTIN, "kvreplay.backends"))
    with pytest.raises(KvreplayError, match="Two backends are named 'hf'"):
        fresh.names()
