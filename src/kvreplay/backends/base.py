"""The backend protocol: what every inference stack declares (design: backend protocol).

A backend is one class: its settings are its dataclass fields (each field's metadata
gives the CLI option and its help, so options, validation and ``--help`` come from the
class), its capabilities say which experiments and arms it can run, and its methods say
what the run's contract and environment record, how a model is checked before a run
writes anything, and how a served model is opened. Experiments ask for capabilities,
never for a backend by name; the registry (:mod:`kvreplay.backends`) names them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

from kvreplay.core.errors import KvreplayError
from kvreplay.core.extras import INSTALL, missing, require
from kvreplay.core.options import Declared, check_bounds, declared, option

if TYPE_CHECKING:
    from kvreplay.backends.roles import RolloutStack, Scorer, WeightUpdater
    from kvreplay.backends.served import ServedModel


# The near-tie bounds of a backend whose numerics are torch's (see Backend.near_tie).
NEAR_TIE = {"bf16": 1.0, "fp16": 1.0, "fp32": 0.05}


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; each experiment and arm asks for what it needs."""

    kv_access: bool  # K/V tensors: fingerprints, comparisons, transplants, snapshots
    cache_control: bool = False  # can force a prefix-cache miss
    cached_token_report: bool = False  # reports the prompt tokens served from cache
    top_logprobs: bool = False  # top-k logprobs of every step
    seeded_sampling: bool = False  # a per-request seed
    batch_control: bool = False  # can put requests in one batch
    rollout: bool = False  # samples with each token's log-probability (a rollout stack)
    scoring: bool = False  # teacher-forces token ids, each position's log-probability (a scorer)
    weight_update: bool = False  # updates its weights mid-run through the engine's own path

    def describe(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name)]


# The types a setting may have, by annotation, and how a refusal names them.
SETTING_TYPES: dict[str, type | tuple[type, ...]] = {
    "int": int, "str": str, "float": (int, float), "bool": bool,
}  # fmt: skip
KIND_NAMES = {"int": "an integer", "str": "a string", "float": "a number", "bool": "true or false"}


# What a serving engine offers: no K/V, but cache control, cached-token reports, top-k
# logprobs and seeded sampling.
SERVED = Capabilities(
    kv_access=False,
    cache_control=True,
    cached_token_report=True,
    top_logprobs=True,
    seeded_sampling=True,
)


@dataclass(frozen=True)
class ModelRef:
    """The model a run names, as a backend opens it: its spec, the digest of its identity
    the run's contract records (a worker refuses other files), and the device."""

    spec: str
    digest: str
    device: str = "cpu"


def companions_setting() -> Any:
    """The batch-composition arm's companions: a setting every served backend takes."""
    return field(
        default=3,
        metadata=option(
            "--companions",
            "Other items' requests sharing the batch-composition arm's batches (0: no such arm).",
            minimum=0,
            maximum=64,
        ),
    )


def trust_remote_code_setting() -> Any:
    """Whether the model's own Python code may run: a setting of every backend that
    executes a model's code (transformers, vLLM); off unless asked for."""
    return field(
        default=False,
        metadata=option(
            "--trust-remote-code",
            "Run the model's own Python code (a model folder that ships it); off by default.",
        ),
    )


@dataclass(frozen=True)
class Backend:
    """Base of every backend: its settings are the subclass's fields."""

    name: ClassVar[str]
    summary: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    # Libraries this backend adds to the contract's environment, each with the
    # distributions that may provide it (a resume or audit refuses other versions).
    libraries: ClassVar[dict[str, tuple[str, ...]]] = {}
    # Whether several workers may run at once: not when they share one server's prefix
    # cache, which every arm resets.
    parallel_workers: ClassVar[bool] = True
    # The precisions (``--dtypes``) this backend runs.
    precisions: ClassVar[tuple[str, ...]] = ("fp32", "bf16", "fp16")
    # The precision whose live rows give fixed prefixes (fixed-prefix, panels): the
    # paper's bf16, unless a backend's own default differs.
    prefix_precision: ClassVar[str] = "bf16"
    # Settings that say where the backend is, not what it computes: left out of the
    # contract, and given again to resume or audit a run (e.g. a server's address).
    connection: ClassVar[tuple[str, ...]] = ()
    # The extra that installs the modules this backend imports (kvreplay.core.extras); the
    # core install has none of them. None: the core install runs the backend.
    extra: ClassVar[str | None] = None
    requires: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        for name, setting in self.settings().items():
            value, kind = getattr(self, name), SETTING_TYPES[setting.kind]
            if not isinstance(value, kind) or (isinstance(value, bool) != (setting.kind == "bool")):
                raise KvreplayError(f"{setting.flag} must be {KIND_NAMES[setting.kind]}.")
        check_bounds(self)
        self.validate()

    def validate(self) -> None:
        """Refuse settings this backend cannot run with (one sentence)."""

    @property
    def kv_access(self) -> bool:
        return self.capabilities.kv_access

    @property
    def trusts_remote_code(self) -> bool:
        """Whether the model's own Python code may run (a setting of the backends that
        execute it; see :func:`trust_remote_code_setting`)."""
        return bool(getattr(self, "trust_remote_code", False))

    @property
    def traffic_clients(self) -> int:
        """Background traffic clients per arm that takes traffic (``--traffic``): a
        backend with a server to send them to says how many."""
        return 0

    def runs_served(self, has_served_form: bool) -> bool:
        """Whether an experiment runs here as served panels: a serving engine serves the
        experiments that have a served form (a hit and a miss of P), and a backend
        without K/V access can run no other kind."""
        return not self.kv_access or (has_served_form and self.capabilities.cache_control)

    @classmethod
    def settings(cls) -> dict[str, Declared]:
        """Each CLI setting by field name: its option, type and default."""
        return declared(cls)

    def for_battery(self) -> Backend:
        """This backend as a check's battery runs it: a backend that starts its own
        engine may size it for the request shapes (vLLM: a small K/V pool)."""
        return self

    def context_window(self, model_context: int) -> int:
        """The tokens one request may span (0: the model does not say)."""
        return model_context

    def contract(self) -> dict[str, Any]:
        """The contract's ``backend`` entry: every setting that can change numerics."""
        return {"name": self.name, **asdict(self)}

    @classmethod
    def version(cls, recorded: dict[str, Any], environment: dict[str, Any]) -> str:
        """What ran a recorded run's rows, for its report: the versions of the libraries
        this backend added to the environment (``?`` where it added none)."""
        return " / ".join(str(environment[k]) for k in cls.libraries if k in environment) or "?"

    @classmethod
    def from_contract(cls, data: dict[str, Any], connection: dict[str, Any]) -> Backend:
        """The backend a contract recorded, reached through ``connection`` (its
        connection settings, given again to resume or audit)."""
        recorded = {f.name: data[f.name] for f in fields(cls) if f.name not in cls.connection}
        return cls(**recorded, **connection)

    def environment(self) -> dict[str, str]:
        """Library versions this backend adds to the contract's environment."""
        return {}

    def near_tie(self, precision: str) -> float:
        """The top-1/top-2 logit margin under which another CPU family's rounding may
        swap two tokens at ``precision`` (an audit on another platform lets a greedy
        trajectory part only there; bench/cross_platform.py measures how far margins
        move): transformers' fp32 moves by about 1e-5, bf16 by up to 0.5."""
        return NEAR_TIE.get(precision, max(NEAR_TIE.values()))

    def kernels(self) -> str | None:
        """What this backend's build reports of the kernel families it runs, beyond the
        CPU's features (contract scheme 4 records it; design: evidence across CPUs)."""
        return None

    def installed(self) -> bool:
        """Whether this environment can run the backend."""
        return not missing(*self.requires)

    @classmethod
    def install_command(cls) -> str | None:
        """The one command that installs what the backend imports (None: nothing)."""
        return INSTALL[cls.extra] if cls.extra else None

    @classmethod
    def check_installed(cls) -> None:
        """Refuse (one sentence naming the install command) when a module the backend
        imports is missing: before anything imports it."""
        if cls.extra:
            require(cls.extra, f"The {cls.name} backend", *cls.requires)

    def check_ready(self) -> None:
        """Refuse (one sentence) when this environment cannot run the backend."""

    def admit(
        self,
        spec: str,
        device: str,
        dtypes: tuple[str, ...],
        scheme: int,
        prompts: list[Any],
        chat: bool | None,
    ) -> tuple[Any, dict[str, Any]]:
        """Everything this backend refuses of a model before a run writes anything, in
        order: the model itself (:meth:`check_model`), the identity it records
        (:meth:`describe_model`) and the prompts' token ids (:meth:`check_tokenization`).
        Returns the model's tokenizer and its ``model_info``."""
        from kvreplay.model.reading import load_tokenizer

        self.check_model(spec, device, dtypes)
        tokenizer = load_tokenizer(spec, self.trusts_remote_code)
        info = self.describe_model(spec, scheme, tokenizer)
        self.check_tokenization(spec, tokenizer, prompts, chat)
        return tokenizer, info

    def check_model(self, spec: str, device: str, dtypes: tuple[str, ...]) -> None:
        """Refuse, before the manifest, a model, device or precision this backend cannot
        run (what would otherwise fail only when a worker loads it)."""

    def check_tokenization(
        self, spec: str, tokenizer: Any, prompts: list[Any], chat: bool | None
    ) -> None:
        """Refuse, before the manifest, prompts the backend would tokenize otherwise."""

    def describe_model(self, spec: str, scheme: int, tokenizer: Any = None) -> dict[str, Any]:
        """The contract's ``model_info``: the identity of the model's files and its
        architecture, read without loading weights
        (:func:`~kvreplay.model.reading.describe_source`); a backend that runs other files
        (a GGUF as shipped) says so."""
        from kvreplay.model.reading import describe_source

        return describe_source(spec, self.trusts_remote_code, scheme, tokenizer)

    def state_layout(self, spec: str, tokens: int) -> tuple[list[str], list[int]] | None:
        """The layer kinds and per-layer lengths of this backend's boundary state over
        ``tokens`` tokens, as a snapshot records them, from the model's config alone;
        None where only a loaded model could say (an audit then holds the snapshots of
        one precision to one layout, each layer to at most ``tokens``)."""
        return None

    def load_model(self, model: ModelRef, precision: str, device_map: str | None = None) -> Any:
        """The model a K/V-access experiment advances boundary states through, for one
        precision: one with :class:`~kvreplay.backends.hf.loading.LoadedModel`'s interface
        (``empty_state``, ``tokenizer``, ``num_layers``, ``model_digest``)."""
        raise KvreplayError(f"The {self.name} backend loads no model with K/V access.")

    trainer_loads: ClassVar[tuple[str, ...]] = ()
    """How it can load a precision for a trainer's scorer (design: rollout stack,
    scorer): ``pretrained`` (as the library's own loader leaves a model at that
    precision, buffers it keeps in fp32 kept: what a trainer loads) or ``cast`` (every
    floating tensor cast to it: what kvreplay's runs load); empty: its one way."""

    def load_trainer(self, model: ModelRef, precision: str, load: str) -> Any:
        """The model a scorer of this backend computes with at a precision, loaded the
        way ``load`` names (one of :attr:`trainer_loads`)."""
        return self.load_model(model, precision)

    def expected_hit(self, computed: int) -> int:
        """How many of ``computed`` prompt tokens a prefix-cache hit must report."""
        return computed

    def open_served(self, model: ModelRef, precision: str) -> ServedModel:
        """A served model for one precision (backends that serve requests)."""
        raise KvreplayError(f"The {self.name} backend serves no model over requests.")

    def rollout_stack(self, opened: Any) -> RolloutStack:
        """This backend as a rollout stack (design: rollout stack) over what it computes
        with at a precision (:func:`kvreplay.backends.rollout.open_model`)."""
        raise KvreplayError(
            f"The {self.name} backend cannot sample with per-token log-probabilities, so it "
            "cannot be a rollout stack."
        )

    def rollout_logprobs(self) -> tuple[str, ...]:
        """The log-probabilities this backend's rollout stack can report (``raw``,
        ``processed``; :mod:`kvreplay.core.rollout`), known before a run."""
        return ()

    def weight_updater(self, opened: Any, model_folder: str) -> WeightUpdater:
        """This backend's own path for updating its weights mid-run (design: weight update
        arm), over what it computes with at a precision and the run's model folder."""
        raise KvreplayError(f"The {self.name} backend cannot update its weights mid-run.")

    def scorer(self, opened: Any, schedule: str = "prefill") -> Scorer:
        """This backend as a scorer (design: scorer) in ``schedule`` (``prefill``: one
        shot; ``replay``: the live schedule) over what it computes with at a precision."""
        raise KvreplayError(f"The {self.name} backend cannot teacher-force token ids (score).")
