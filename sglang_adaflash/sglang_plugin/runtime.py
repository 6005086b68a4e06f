"""The ADAFLASH pieces the SGLang worker holds, kept free of SGLang's worker class.

- :func:`load_length_head` reads the ``thresh_head_two_model.*`` weights of an AdaFlash drafter
  checkpoint into the reference engine's :class:`AdaptiveLengthHead` (same module, same weights);
- :class:`SGLangDraftTarget` lets the hot-reload logic write into SGLang's DFlash draft model in
  place, through the model's own ``load_weights`` (which fuses q/k/v and gate/up and shards for
  tensor parallelism by copying into the existing parameters);
- :func:`refresh_fused_kv_helper` refreshes the stacked weight copies SGLang's fused draft-KV
  helper derives from the draft's k/v projections, in place;
- :class:`StepStatsQueue` matches each step's verify lengths with the accept counts SGLang hands
  back on the host later (``on_verify_complete_cpu``), so metrics cost no GPU sync.
"""

from __future__ import annotations

import json
import logging
import os
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from sglang_adaflash.drafter.length_head import AdaptiveLengthHead
from sglang_adaflash.serving.metrics import MetricsSink, SpecStepStats
from sglang_adaflash.serving.reload import ReloadError, TensorSpec, is_version

logger = logging.getLogger(__name__)

HEAD_PREFIX = "thresh_head_two_model."


class HeadLoadError(ValueError):
    """The drafter's length head cannot be loaded; the message says why and what to do."""


def local_checkpoint_dir(path: str) -> Path:
    """A local directory for a drafter path: the path itself, or the local Hugging Face cache
    snapshot SGLang downloaded for a hub id (never downloads)."""
    p = Path(path)
    if p.is_dir():
        return p
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, local_files_only=True))
    except Exception as e:
        raise HeadLoadError(
            f"drafter {path!r} is neither a local directory nor in the local Hugging Face cache "
            f"({e}); pass a local --speculative-draft-model-path"
        ) from None


def read_head_state(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """The length-head tensors (prefix stripped) from the checkpoint's safetensors files."""
    from safetensors import safe_open

    files = sorted(checkpoint_dir.glob("*.safetensors"))
    if not files:
        raise HeadLoadError(f"{checkpoint_dir} has no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                if key.startswith(HEAD_PREFIX):
                    state[key[len(HEAD_PREFIX) :]] = fh.get_tensor(key)
    return state


def load_length_head(
    checkpoint_dir: Path, hidden_size: int, bottleneck_dim: int, device
) -> AdaptiveLengthHead:
    """The reference engine's head with the checkpoint's weights, in float32 on ``device``."""
    state = read_head_state(checkpoint_dir)
    if not state:
        raise HeadLoadError(
            f"{checkpoint_dir} enables the length head in config.json but has no "
            f"{HEAD_PREFIX}* weights; republish the drafter with its head or disable it "
            "(ADAFLASH_LENGTH_HEAD=off)"
        )
    head = AdaptiveLengthHead(hidden_size, bottleneck_dim)
    try:
        head.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise HeadLoadError(
            f"{checkpoint_dir}: the {HEAD_PREFIX}* weights do not fit a head with hidden size "
            f"{hidden_size} and bottleneck {bottleneck_dim} ({e}); check "
            "dflash_config.thresh_head_bottleneck_dim"
        ) from None
    return head.float().to(device).eval()


def sglang_resolved_fields(raw: Mapping, *, mask_token: str | None, mask_token_id: int | None):
    """What SGLang's DFLASH resolved for a drafter config that leaves it out, in the form
    :meth:`DrafterConfig.from_dict` takes: the mask token's id (SGLang resolves a string
    ``mask_token`` with the target's tokenizer) and the target layer count, by the rule of
    SGLang's ``DFlashDraftModel``: ``num_target_layers`` (in ``dflash_config`` or at the top
    level), else ``max(target_layer_ids) + 1``, else the draft's own layer count."""
    dflash = raw.get("dflash_config") or {}
    layers = dflash.get("num_target_layers", raw.get("num_target_layers"))
    ids = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
    if layers is None:
        layers = max(int(i) for i in ids) + 1 if ids else raw.get("num_hidden_layers")
    out = {"num_target_layers": layers}
    if mask_token_id is not None:
        out.update(mask_token=mask_token, mask_token_id=int(mask_token_id))
    return out


def initial_version(checkpoint_dir: Path, env: Mapping[str, str] | None = None) -> str:
    """The version name of the drafter given at start-up."""
    env = os.environ if env is None else env
    if env.get("ADAFLASH_DRAFTER_VERSION"):
        return env["ADAFLASH_DRAFTER_VERSION"]
    try:
        manifest = json.loads((checkpoint_dir / "manifest.json").read_text())
        if isinstance(manifest, dict) and isinstance(manifest.get("version"), str):
            return manifest["version"]
    except (OSError, json.JSONDecodeError):
        pass
    name = checkpoint_dir.resolve().name
    return name if is_version(name) else f"initial:{name}"


class SGLangDraftTarget:
    """Hot-reload target over SGLang's DFlash draft model (checkpoint names -> live params)."""

    def __init__(
        self,
        draft_model: torch.nn.Module,
        expected: Mapping[str, TensorSpec],
        *,
        context: Callable[[], object] | None = None,
        refresh: Callable[[], None] | None = None,
    ):
        self.draft_model = draft_model
        self._expected = dict(expected)
        self._context = context
        self._refresh = refresh

    def expected(self) -> dict[str, TensorSpec]:
        return dict(self._expected)

    def live_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.draft_model.named_parameters())

    def write(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy host tensors into the live draft through SGLang's own ``load_weights``.

        The tensors stay in (pinned) host memory in the checkpoint's dtypes, as at start-up;
        each goes to the device only while its loader runs (one tensor at a time, queued
        without waiting: the caching allocator reuses the block in stream order), so a reload
        never holds a second copy of the drafter on the GPU, outside SGLang's memory plan.
        """
        why = quantized_draft_reason(self.draft_model)
        if why:
            raise ReloadError(why)
        device = next(self.draft_model.parameters()).device

        def one_at_a_time():
            for name, tensor in state.items():
                yield name, tensor.to(device, non_blocking=True)

        ctx = self._context() if self._context is not None else _null_context()
        with torch.no_grad(), ctx:
            self.draft_model.load_weights(one_at_a_time())

    def refresh(self) -> None:
        if self._refresh is not None:
            self._refresh()


class _null_context:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def expected_draft_spec(config, dtypes: Mapping[str, torch.dtype]) -> dict[str, TensorSpec]:
    """Checkpoint names, shapes and dtypes of the draft (length head excluded).

    ``dtypes`` holds each tensor's dtype in the checkpoint the server started from
    (:func:`checkpoint_dtypes`): a reload hands SGLang's loaders what they loaded at start-up,
    tensor by tensor, whatever dtype the live parameters ended up in."""
    from sglang_adaflash.drafter.checkpoint import expected_shapes

    return {
        name: (shape, dtypes[name])
        for name, shape in expected_shapes(config).items()
        if not name.startswith(HEAD_PREFIX)
    }


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


def checkpoint_dtypes(checkpoint_dir: Path) -> dict[str, torch.dtype]:
    """Each tensor's dtype from the safetensors headers (no tensor is read)."""
    from safetensors import safe_open

    out: dict[str, torch.dtype] = {}
    for f in sorted(Path(checkpoint_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                code = fh.get_slice(key).get_dtype()
                if code not in _SAFETENSORS_DTYPES:
                    raise HeadLoadError(f"{f}: {key} has dtype {code}, not a float dtype")
                out[key] = _SAFETENSORS_DTYPES[code]
    return out


def quantized_draft_reason(draft_model: torch.nn.Module) -> str | None:
    """Why a hot reload cannot write this draft in place, or None.

    SGLang gives the draft the target's ``--quantization`` by default; an online-quantized
    draft quantizes its weights once, after loading, into parameters of another dtype and
    layout, so copying a new version through ``load_weights`` would store unquantized values
    in quantized storage."""
    for name, module in draft_model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and not type(method).__name__.startswith("Unquantized"):
            return (
                f"the draft model is quantized ({name or 'model'}: {type(method).__name__}), "
                "and a quantized draft cannot be hot-reloaded in place; serve the drafter "
                "unquantized (--speculative-draft-model-quantization unquant) to reload it"
            )
    return None


def refresh_fused_kv_helper(helper, layers) -> None:
    """Re-derive SGLang's FusedKVMaterializeHelper weight stacks from the draft layers, in place
    (the stacks may be referenced by captured graphs, so they are overwritten, not rebuilt)."""
    if helper is None:
        return
    with torch.no_grad():
        col = 0
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            rows = attn.qkv_proj.weight[attn.q_size : attn.q_size + 2 * attn.kv_size]  # [2kv, H]
            # flat_kv_weight_t [H, L*2kv]: layer i's k and v rows are columns col..col+2kv
            helper.flat_kv_weight_t[:, col : col + rows.shape[0]].copy_(rows.transpose(0, 1))
            helper.k_norm_weights[i].copy_(attn.k_norm.weight)
            col += rows.shape[0]


class StepStatsQueue:
    """Pairs each step's verify lengths with the accept counts SGLang reports later on the host.

    SGLang calls ``on_verify_complete_cpu`` once per decode step, in step order, after the
    accept lengths reached the host; overlap scheduling only delays it. Steps whose counts never
    arrive (a request retracted mid-step) are dropped when the batch size does not match.
    """

    def __init__(self, sink: MetricsSink, maxlen: int = 64):
        self.sink = sink
        self._pending: deque[tuple[int, object, list[str | None] | None]] = deque(maxlen=maxlen)

    def push(self, block_size: int, verify_lens, domains: list[str | None] | None):
        """``verify_lens``: a host list, or the step's [bs] lengths on the device, copied to
        pinned host memory behind the step's kernels (read in :meth:`complete`, by when
        SGLang has waited for the step's accept counts, so the copy has landed)."""
        if isinstance(verify_lens, torch.Tensor):
            verify_lens = _HostCopy(verify_lens)
        else:
            verify_lens = list(verify_lens)
        self._pending.append((block_size, verify_lens, domains))

    def complete(self, accepted_per_req: list[int]) -> SpecStepStats | None:
        while self._pending:
            block, lens, domains = self._pending.popleft()
            if isinstance(lens, _HostCopy):
                lens = lens.tolist()
            if len(lens) != len(accepted_per_req):
                continue  # a step that reported no counts; try the next one
            accepted = [max(0, min(a, n - 1)) for a, n in zip(accepted_per_req, lens)]
            stats = SpecStepStats.trusted(block, lens, accepted, domains)  # bounded above
            try:
                self.sink.observe_step(stats)
            except Exception:  # metrics must never break decoding
                logger.exception("adaflash: metrics sink failed")
            return stats
        return None


class _HostCopy:
    """A device tensor's values on their way to the host (pinned, non-blocking)."""

    def __init__(self, t: torch.Tensor):
        self._event = None
        if t.is_cuda:
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = t.detach().clone()

    def tolist(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()  # long done: SGLang already waited for this step
        return [int(n) for n in self._host.tolist()]
