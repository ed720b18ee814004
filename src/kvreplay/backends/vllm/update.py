"""The vllm backend's weight updates (design: weight update arm): vLLM's engine in this
process reloads its weights in place through its own path (the workers'
``reload_weights``, what an RL framework's sync calls; new weights streamed from
:class:`~kvreplay.model.update.WeightUpdate`, the run's own read back from its folder),
and a correct sync then resets the prefix cache. A request in flight is stepped by the
engine itself (``LLMEngine.add_request`` / ``step``) and the weights are reloaded between
two of its steps, its earlier K/V kept, as asynchronous RL continues it. Imports vLLM."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from kvreplay.backends.vllm.rollout import sampling_params, turn_of
from kvreplay.core.errors import KvreplayError, first_line
from kvreplay.core.rollout import Conversation, Turn
from kvreplay.model.update import WeightUpdate

_IDS = itertools.count()


class VllmUpdater:
    """vLLM's engine (a :class:`~kvreplay.backends.vllm.VllmServed`) updating its weights."""

    inflight = True

    def __init__(self, served: Any, model_folder: str):
        self.served, self.folder = served, Path(model_folder)

    def _reload(self, weights: WeightUpdate | None) -> None:
        if weights is None or weights.folder is not None:
            folder = self.folder if weights is None else weights.source(self.folder)
            kwargs: dict[str, Any] = {"weights_path": str(folder)}
        else:
            kwargs = {"weights_iterator": weights.tensors(self.folder)}
        try:
            self.served.engine.collective_rpc("reload_weights", kwargs=kwargs)
        except Exception as exc:  # noqa: BLE001 - the engine raises many kinds
            raise KvreplayError(
                f"vLLM could not reload its weights ({type(exc).__name__}: {first_line(exc)})."
            ) from exc

    def sync(self, weights: WeightUpdate | None) -> None:
        self._reload(weights)
        self.served.reset_cache()

    def sample_inflight(self, conversation: Conversation, at: int, weights: WeightUpdate) -> Turn:
        engine = self.served.engine.llm_engine
        request = f"kvreplay-inflight-{next(_IDS)}"
        params = sampling_params(conversation, self.served.eos_token_ids)
        engine.add_request(request, {"prompt_token_ids": list(conversation.prompt_ids)}, params)
        updated, last = False, None
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id != request:
                    continue
                last = output
                if not updated and len(output.outputs[0].token_ids) >= at:
                    self._reload(weights)  # between two steps: its K/V so far kept
                    updated = True
        if last is None:
            raise KvreplayError("vLLM's engine returned nothing for an in-flight request.")
        return turn_of(last)
