"""The Hugging Face transformers baseline: the same weights and prompts through `generate`.

Import this module only when the arm runs: it imports transformers.

The model is AutoModelForCausalLM on the same directory, device and dtype as the engine, with
SDPA attention. With `--load-format dummy` it is built from config.json and given the engine's
own dummy values (`kvtool.engine.models.iter_checkpoint_tensors`, the same seed on the same device),
so its output can be compared token for token there too.

Reuse is transformers' own: the prefix is prefilled into a DynamicCache outside the timer, and
each timed `generate` starts from a copy of it. TTFT is the time from calling `generate` to the
first call of a logits processor, which runs right after the forward that yields token one.
EOS never stops generation (as `ignore_eos`), so outputs have the requested length.
"""

from __future__ import annotations

import copy
import inspect
import time
from pathlib import Path

import torch
from transformers import LogitsProcessor

from kvtool.engine.errors import ModelError
from kvtool.engine.kv.identity import resolve_device, resolve_dtype
from kvtool.engine.params import EngineParams


class HFBaseline:
    """One transformers model, ready to time `generate` on token-id prompts."""

    def __init__(self, model_path: str | Path, params: EngineParams) -> None:
        """Load the model at `model_path` as `params` asks (device, dtype, load format, seed).

        Raises ModelError when transformers cannot build the model or a dummy parameter has no
        counterpart in it.
        """
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self.device = resolve_device(params.device)
        self.dtype = resolve_dtype(params.dtype, self.device)
        path = Path(model_path)
        try:
            if params.load_format == "dummy":
                config = AutoConfig.from_pretrained(path)
                with torch.device(self.device):
                    model = AutoModelForCausalLM.from_config(config, dtype=self.dtype, attn_implementation="sdpa")
                self._load_dummy(model, path, params.seed)
            else:
                model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype, attn_implementation="sdpa")
                model.to(self.device)
        except (OSError, ValueError, KeyError) as e:
            raise ModelError(f"transformers cannot load {path}: {e}") from None
        self.model = model.eval()
        forward_params = inspect.signature(self.model.forward).parameters
        # transformers 5 renamed `past_key_values` to `cache`.
        self.cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"

    @property
    def is_float32(self) -> bool:
        """Whether its outputs are expected to equal the engine's token for token (below float32,
        two implementations round differently)."""
        return self.dtype == torch.float32

    def _load_dummy(self, model: torch.nn.Module, path: Path, seed: int) -> None:
        from kvtool.engine.models import iter_checkpoint_tensors
        from kvtool.engine.models.model_dir import open_model_dir

        params = dict(model.named_parameters())
        assigned = set()
        with torch.no_grad():
            for name, value in iter_checkpoint_tensors(open_model_dir(path).config, self.device, seed):
                if name not in params:
                    raise ModelError(f"transformers' model has no parameter {name!r} for the dummy weights")
                params[name].copy_(value)
                assigned.add(name)
        model.tie_weights()
        # named_parameters lists a tied output matrix once, under the embedding's name.
        missing = sorted(set(params) - assigned)
        if missing:
            raise ModelError(f"the dummy weights leave transformers' parameters unset: {', '.join(missing[:5])}")

    def prefill_cache(self, prefix_ids: list[list[int]]):
        """A cache holding `prefix_ids` (one row per sequence, equal lengths); None when empty."""
        if not prefix_ids or not prefix_ids[0]:
            return None
        ids = torch.tensor(prefix_ids, device=self.device)
        with torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=True)
        return getattr(out, "cache", None) or out.past_key_values

    def generate(self, prompts: list[list[int]], max_new_tokens: int, cache=None) -> tuple[float, list[list[int]]]:
        """Greedy `generate` of a batch of equal-length prompts, from a copy of `cache` if given.

        Returns (TTFT in seconds, output ids per prompt).
        """
        from transformers import GenerationConfig, LogitsProcessorList

        ids = torch.tensor(prompts, device=self.device)
        timer = _FirstTokenTimer()
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0)
        kwargs = {self.cache_kwarg: copy.deepcopy(cache)} if cache is not None else {}
        with torch.inference_mode():
            self._sync()
            t0 = time.perf_counter()
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), generation_config=config,
                logits_processor=LogitsProcessorList([timer]), **kwargs,
            )
            self._sync()
        ttft = (timer.first_s or time.perf_counter()) - t0
        return ttft, out[:, ids.shape[1]:].tolist()

    def generate_padded(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy `generate` of prompts of any lengths (left-padded); output ids per prompt."""
        from transformers import GenerationConfig

        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long, device=self.device)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, device=self.device)
            mask[i, width - len(p):] = 1
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0)
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, generation_config=config)
            self._sync()
        return out[:, width:].tolist()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


class _FirstTokenTimer(LogitsProcessor):
    """A logits processor that notes when it is first called (token one's logits exist)."""

    def __init__(self) -> None:
        self.first_s: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.first_s is None:
            if scores.is_cuda:
                torch.cuda.synchronize(scores.device)
            self.first_s = time.perf_counter()
        return scores
