"""The ``kvreplay`` command line: a thin click group; the work lives in the modules."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from kvreplay.errors import KvreplayError, exit_plainly, plain_errors


class PlainGroup(click.Group):
    """Every refusal, from option parsing on, ends in one sentence on stderr and exit 2."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            exit_plainly(exc.format_message())
        except KvreplayError as exc:
            exit_plainly(str(exc))


def _parsed(parse: Callable[[Any], Any]) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """A click callback that validates an option with the library's own parser."""

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        try:
            return parse(value)
        except KvreplayError as exc:
            raise click.BadParameter(str(exc), ctx, param) from exc

    return callback


def _dtypes(value: str) -> tuple[str, ...]:
    from kvreplay.models import parse_dtypes

    return parse_dtypes(v.strip() for v in value.split(",") if v.strip())


def _device(value: str) -> str:
    from kvreplay.models import parse_device

    return parse_device(value)


def threads_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--threads``: torch intra-op threads per worker process (default one; see
    :mod:`kvreplay.threads`)."""
    from kvreplay.threads import DEFAULT_THREADS

    return click.option(
        "--threads", type=click.IntRange(min=1), default=DEFAULT_THREADS, show_default=True,
        help="torch threads per worker process; a resume or audit needs the run's count.",
    )(func)  # fmt: skip


def run_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Options shared by every ``run`` experiment (and the demo)."""
    options = [
        click.option("--model", default="smollm2-135m", show_default=True,
                     help="Embedded model name, local folder, GGUF file, or cached hub id."),
        click.option("--items", "items_source", default="arith", show_default=True,
                     help="Built-in item set or a JSONL file."),
        click.option("--n", type=int, default=None,
                     help="How many items (default: all; bridge 12)."),
        click.option("--dtypes", default="bf16,fp32", show_default=True, callback=_parsed(_dtypes),
                     help="Comma-separated precisions: fp32, bf16, fp16."),
        click.option("--plan", default="instruct", show_default=True,
                     help="Built-in stage plan (instruct, reasoning, short) or a plan .json."),
        click.option("--extractor", default="integer", show_default=True,
                     help="Answer extractor: integer, choice or boxed."),
        click.option("--device", default="cpu", show_default=True, callback=_parsed(_device),
                     help="cpu, cuda or cuda:N."),
        click.option("--temperature", type=float, default=0.0, show_default=True,
                     help="0 is greedy; above 0 samples with --seed."),
        click.option("--top-p", type=float, default=1.0, show_default=True),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--chat/--no-chat", default=None,
                     help="Force the chat template on or off (default: use it if present)."),
        click.option("--attn", default="sdpa", show_default=True,
                     help="Attention implementation passed to transformers."),
        click.option("--trust-remote-code", is_flag=True, default=False),
        click.option("--save-snapshots", is_flag=True, default=False,
                     help="Also save boundary states as safetensors (large for big models)."),
        click.option("--engine", type=click.Choice(["local", "ray"]), default="local",
                     show_default=True),
        click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Worker processes (local: spawned on this machine; ray: actors)."),
        click.option("--gpus-per-worker", type=click.FloatRange(min=0), default=0.0,
                     show_default=True),
        click.option("--ray-address", default=None, help="Join this Ray cluster."),
        threads_option,
    ]  # fmt: skip
    for option in reversed(options):
        func = option(func)
    return func


PANEL_OPTIONS = ("panel", "alias", "name", "divergent", "controls", "panel_seed", "both_directions")


def panel_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Options of ``transplant`` and ``localize``; they reach the run as ``extra``."""
    options = [
        click.option("--panel", type=click.Choice(["stratified", "blind"]), default=None,
                     help="transplant: a prior run's divergent rows plus exact controls "
                          "(stratified, default) or an outcome-blind length spread (blind)."),
        click.option("--alias", default=None, help="transplant: checkpoint alias (e.g. C0)."),
        click.option("--name", default=None,
                     help="transplant: ledger kv_transplant_<name>.csv "
                          "(default primary for stratified, later for blind)."),
        click.option("--divergent", type=click.IntRange(min=0), default=None,
                     help="Divergent rows to take from --from (transplant 24, localize all)."),
        click.option("--controls", type=click.IntRange(min=0), default=None,
                     help="transplant: exact control rows to take from --from (default 8)."),
        click.option("--panel-seed", type=int, default=None,
                     help="Seed that orders equal-length rows in a panel (default 0)."),
        click.option("--both-directions", is_flag=True, default=False,
                     help="localize: also probe prefill K/V into the replay state."),
    ]  # fmt: skip
    for option in reversed(options):
        func = option(func)
    return func


def _request(experiment: str, out: Path, kwargs: dict[str, Any]) -> Any:
    from kvreplay.decode import Sampler
    from kvreplay.runner import RunRequest

    return RunRequest(
        experiment=experiment,
        out=out,
        model=kwargs["model"],
        items=kwargs["items_source"],
        n=kwargs["n"],
        dtypes=kwargs["dtypes"],
        plan=kwargs["plan"],
        extractor=kwargs["extractor"],
        device=kwargs["device"],
        sampler=Sampler(kwargs["temperature"], kwargs["top_p"], kwargs["seed"]),
        chat=kwargs["chat"],
        attn_implementation=kwargs["attn"],
        trust_remote_code=kwargs["trust_remote_code"],
        save_snapshots=kwargs["save_snapshots"],
        prefix_from=kwargs.get("prefix_from"),
        engine=kwargs["engine"],
        workers=kwargs["workers"],
        gpus_per_worker=kwargs["gpus_per_worker"],
        ray_address=kwargs["ray_address"],
        threads=kwargs["threads"],
        extra=kwargs.get("extra", {}),
    )


@click.group(cls=PlainGroup)
@click.version_option(package_name="kvreplay")
def main() -> None:
    """Audit stage replay: does a prefix rebuilt by prefill continue like the live state?"""


@main.command("run")
@click.argument("experiment")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Run directory.")
@click.option(
    "--prefix-from",
    "--from",
    "prefix_from",
    type=click.Path(path_type=Path),
    default=None,
    help="Take prefixes (fixed-prefix), historical prefixes (bridge) or the panel "
    "(transplant, localize) from this run.",
)
@run_options
@panel_options
@plain_errors
def run_command(experiment: str, out: Path, **kwargs: Any) -> None:
    """Run (or resume) EXPERIMENT: matched, fixed-prefix, bridge, transplant or localize."""
    from kvreplay.runner import run

    panel = {key: kwargs.pop(key) for key in PANEL_OPTIONS}
    kwargs["extra"] = {k: v for k, v in panel.items() if v is not None and v is not False}
    run(_request(experiment, out, kwargs))
    click.echo(f"Ledger: {out}")


@main.command("demo")
@click.option(
    "--out", type=click.Path(path_type=Path), default=Path("runs/demo"), show_default=True
)
@click.option(
    "--n", type=click.IntRange(min=1), default=3, show_default=True, help="Items per experiment."
)
@click.option(
    "--workers", type=click.IntRange(min=1), default=None,
    help="Local worker processes (default: one per core, at most one per row).",
)  # fmt: skip
@threads_option
@plain_errors
def demo_command(out: Path, n: int, workers: int | None, threads: int) -> None:
    """All three experiments on the embedded default model, then analysis and report."""
    from kvreplay.demo import run_demo

    run_demo(out, n, workers=workers, threads=threads)


@main.command("audit")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option(
    "--sample",
    type=click.IntRange(min=0),
    default=None,
    help="Re-execute a seeded sample of K rows.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--engine", type=click.Choice(["local", "ray"]), default="local", show_default=True)
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--gpus-per-worker", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option("--ray-address", default=None)
@threads_option
@plain_errors
def audit_command(run_dir: Path, sample: int | None, seed: int, **options: Any) -> None:
    """Re-execute a run's rows and verify every fingerprint, hash and derived CSV."""
    from kvreplay.audit import audit, format_audit

    result = audit(
        run_dir, sample=sample, seed=seed, announce=lambda s: click.echo(s, err=True), **options
    )
    click.echo(format_audit(result))
    sys.exit(0 if result.passed else 1)


def _add_analysis_commands() -> None:
    from kvreplay.analysis.cli_commands import analyze, report

    main.add_command(analyze)
    main.add_command(report)


_add_analysis_commands()
