"""The memory of ``memtrain generate``: transformers' ``generate`` with its KV cache, without running it.

``memtrain generate`` samples through transformers' ``generate`` (memtrain.inference.generate),
memtrain's GPT mapped onto ``GPT2LMHeadModel`` with a ``gelu_pytorch_tanh`` MLP. What it holds
(transformers 5.x, no grad, SDPA, every prompt the same length, no padding):

* the weights;
* the KV cache, a ``DynamicCache``: per layer a key and a value tensor of shape (batch, kv heads,
  length, head dim) in the compute dtype, grown by ``torch.cat`` each step, so while a layer
  grows its old tensor and the new one (one position longer) both live. The prompt's forward
  (the prefill) fills ``prompt`` positions and each of the ``new_tokens - 1`` decode steps adds
  one (the last sampled token is never fed back): ``prompt + new_tokens - 1`` positions at the end;
* with a sliding window ``W`` on every layer (config.json's ``sliding_window``: Mistral,
  Phi-3), a ``DynamicSlidingWindowLayer`` per layer instead: each step concatenates both the key
  and the value before it lets either old tensor go (two old tensors beside two new ones), and
  keeps a view of the last ``W - 1`` positions of the concatenation, so a layer's storage is the
  prompt after the prefill, then at most ``W`` positions from the first decode step on (a prompt
  longer than ``W`` is freed layer by layer in that first step). From ``W`` positions on,
  transformers builds the windowed bool mask (masking_utils' ``sdpa_mask``: (prompt, prompt),
  expanded to the batch as a view, held by the model's forward), and the prefill's SDPA gets it
  instead of ``is_causal``: grouped k/v heads are then repeated (``repeat_kv``: copies of the
  prompt's k and v at the query's width; a view with one k/v head) and torch's SDPA turns the bool mask into a float one
  (batch, 1, prompt, prompt) in the compute dtype, beside its output and its float32 logsumexp
  (batch x heads x prompt). A decode step's mask is one query row (no repeat: ``pack_gqa``);
  those few bytes are left out;
* the prefill's transient activations over ``batch x prompt`` tokens, largest in the last
  layer's MLP, where every layer's cache is written: the MLP's intermediates (SwiGLU: SiLU(gate),
  up and their product; Phi-3's fused gate/up output besides; GPT-2's ``gelu_new`` formula: four
  (tokens, d_ff) tensors at once; a fused GELU: two), the residual stream, the normed input,
  the layer's input (held by the model's loop), the embedding output (held by the model until
  it returns; GPT-2's token and position embeddings, and the attention output its block holds),
  and rope's cos/sin tables (batch x prompt x head dim each);
* the logits of the last position only (``generate`` passes ``logits_to_keep=1``), and the
  sampling head: a float32 copy of them, the temperature's and top-k's outputs, top-k's bool
  mask and the softmax (greedy: the copy alone). Those of one step live until the next step
  replaces them, so a decode step's cache update runs beside the previous step's, and its
  sampling beside both;
* the token ids, attention mask and positions (int64, ``batch x length``).

Attention is SDPA (what ``memtrain generate`` loads): with no padding the mask is None, grouped
k/v heads go to the kernel as they are (``enable_gqa``; one query: ``pack_gqa``), so no
repeated copy is made (a window's mask aside, above). The peak is the largest of the prefill's
last layer (MLP or attention), the prefill's sampling, and the last decode step's cache update
(with a window the first step's too), its last layer's MLP or rope (``decode step``) and sampling.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

from memtrain.analysis.estimate.params import head_widths, param_count
from memtrain.config.archs import Arch
from memtrain.config.run import ModelConfig
from memtrain.techniques.facts import GENERATE_DTYPES

# Bytes per element of a weights dtype (int8/int4: the stored weights; they compute in 16 bits).
DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "int8": 1, "int4": 0.5}
ID_BYTES = 8  # token ids, attention mask and positions are int64
FP32 = 4  # the sampling head runs in float32 (generate copies the logits to float32)
DEFAULT_NEW_TOKENS = 64  # memtrain generate --max-new-tokens, and estimate --new-tokens
TOP_K = 50  # memtrain generate --top-k's default, which the sampling head is estimated with

__all__ = ["DEFAULT_NEW_TOKENS", "DTYPE_BYTES", "GENERATE_DTYPES", "TOP_K", "estimate_generate", "kv_cache_bytes",
           "mlp_width_factor"]


def kv_cache_bytes(n_layers: int, batch: int, kv_width: int, length: int, elem: int) -> int:
    """A DynamicCache of ``length`` positions: a key and a value tensor per layer, each
    (batch, kv heads, length, head dim) = ``batch x length x kv_width`` elements of ``elem`` bytes."""
    return 2 * n_layers * batch * kv_width * length * elem


def mlp_width_factor(arch: Arch) -> int:
    """How many (tokens, d_ff) tensors the MLP holds at once without autograd (see the module
    docstring): SwiGLU 3 (Phi-3's fused gate/up 4), GPT-2's gelu_new formula 4, a fused GELU 2."""
    if arch.mlp == "swiglu":
        return 4 if arch.fused_proj else 3
    return 4 if arch.mlp == "gelu_new" else 2


def _layer_windows(window: Optional[int], sliding_layers: Optional[Sequence[bool]], n_layers: int,
                   ) -> list[Optional[int]]:
    """Each layer's window (None: a full-attention layer, whose cache keeps every position)."""
    if window is not None and window < 2:
        raise ValueError("a sliding window keeps at least 2 positions")
    if sliding_layers is not None and len(sliding_layers) != n_layers:
        raise ValueError(f"sliding_layers names {len(sliding_layers)} layers of {n_layers}")
    return [window if (sliding_layers is None or slides) else None for slides in (sliding_layers or [True] * n_layers)]


def _prefill_attention(arch: Arch, token_bytes: float, d: int, qw: int, kvw: int, cache_prompt: float,
                       layer_cache: float) -> tuple[float, float]:
    """The prefill's last-layer attention candidate: the bytes its attention holds at its largest
    (``token_bytes``: the prompt's tokens times the compute dtype's bytes) and the KV cache
    written by then."""
    if arch.name == "gpt2":
        # At c_proj: ln_1's output, c_attn's (q is a view of it; SDPA's output takes its layout,
        # so no copy) and SDPA's output; this layer's k/v are in the cache.
        return token_bytes * (d + (qw + 2 * kvw) + qw), cache_prompt
    if arch.fused_proj:
        # Phi-3, after SDPA: the normed input, the fused q/k/v output (v is a view of it), q
        # after rope (its cat makes it contiguous as (b, h, s, hd)), SDPA's output in that
        # layout and the transpose's contiguous copy; this layer's k/v are in the cache.
        return token_bytes * (d + (qw + 2 * kvw) + 3 * qw), cache_prompt
    # rope, before the cache update: the normed input, q, k, v, and q's three temporaries
    # (q * cos, the rotated q times sin, their sum); then k's three beside q's result,
    # which is the larger where k is as wide as q (no grouped heads).
    return token_bytes * (d + max(4 * qw + 2 * kvw, 2 * qw + 5 * kvw)), cache_prompt - layer_cache


def estimate_generate(m: ModelConfig, arch: Arch, batch: int, prompt: int, new_tokens: int,
                      weights_dtype: str, sampling: bool = True, window: Optional[int] = None,
                      sliding_layers: Optional[Sequence[bool]] = None) -> dict[str, Any]:
    """Peak memory of ``generate`` sampling ``new_tokens`` tokens after a ``prompt``-token prompt
    for each of ``batch`` sequences, weights in ``weights_dtype`` (one of :data:`GENERATE_DTYPES`).
    ``sampling``: memtrain generate's default (temperature and top-k); False: greedy.
    ``window``: the sliding window the layers' attention and cache keep (config.json's
    ``sliding_window``), or None; ``sliding_layers``: which layers slide (Qwen2's
    ``max_window_layers``: the later ones), None for every one.

    ``m``/``arch``: the model's shape (a transformers family's Arch, or memtrain's GPT's, which
    generate runs as GPT2LMHeadModel). The KV cache term is exact; the transient terms count the
    tensors transformers' code holds (module docstring)."""
    if new_tokens < 1:
        raise ValueError("generate samples at least one token")
    n_params = param_count(m, arch)[0]
    wb = DTYPE_BYTES[weights_dtype]
    a = int(wb)  # the compute dtype is the weights' (fp32, bf16, fp16)
    b, s, d, V, L = batch, prompt, m.d_model, m.vocab_size, m.n_layers
    qw, kvw = head_widths(m, arch)
    hd = arch.head_dim or m.head_dim
    N = b * s
    gpt2 = arch.name == "gpt2"
    final_len = s + new_tokens - 1
    windows = _layer_windows(window, sliding_layers, L)
    weights = n_params * wb
    cache = sum(kv_cache_bytes(1, b, kvw, _stored(s, new_tokens, w), a) for w in windows)
    cache_prompt = kv_cache_bytes(L, b, kvw, s, a)
    layer_cache = kv_cache_bytes(1, b, kvw, s, a)
    # From `window` positions on the prefill's sliding layers are masked (module docstring): the
    # model then holds the mask, and the last layer's SDPA takes it where that layer slides.
    masked = window is not None and s >= window
    masked_last = masked and windows[-1] is not None

    # The prefill: what the model holds across its layers, then the last layer's two candidates:
    # its attention (a cache of `attn_cache` bytes written by then) and its MLP (all of it).
    held = _held_bytes(arch, m, b, s, a)
    attn, attn_cache = _prefill_attention(arch, N * a, d, qw, kvw, cache_prompt, layer_cache)
    if masked:
        held += s * s  # the bool windowed mask, the model's local until it returns
    mlp = _mlp_bytes(arch, m, N, a)
    # The prompt, its mask, its positions and the model's copy of the ids; the unfinished-sequence flags.
    ids_prefill = 4 * b * s * ID_BYTES + b * ID_BYTES
    layer_mlp = cache_prompt + held + mlp
    layer_attn = attn_cache + held + attn
    attn_detail = "the last layer before its MLP"
    if masked_last:
        # Inside the masked SDPA: the normed input, q after rope, the repeated k and v (where k/v
        # heads are grouped; the cache's own tensors otherwise), the float mask, the output and
        # its logsumexp; Phi-3 holds its fused q/k/v output besides (v is a view of it).
        repeated = 2 * qw if _repeat_copies(qw, kvw, hd) else 0
        inside = (N * a * (d + 2 * qw + repeated + ((qw + 2 * kvw) if arch.fused_proj else 0))
                  + b * s * s * a + b * m.n_heads * s * FP32)
        if cache_prompt + held + inside > layer_attn:
            layer_attn, attn_cache = cache_prompt + held + inside, cache_prompt
            attn_detail = "the last layer's masked SDPA"
    if not gpt2:
        # The post-attention RMSNorm (float32 inside): the residual, the float32 input (the residual
        # itself in float32) and the normalized tensor with its per-token mean and rstd; in float32
        # at its end the residual, the normalized tensor and the output.
        # Gemma's norm (``norm_offset``) takes ``x.pow(2).mean(-1, keepdim=True)`` straight into
        # rsqrt, no local keeping it: one per-token float32 tensor at a time (two counted, a Gemma
        # of width 12 over 2 x 33 tokens was +1.36% over the measured prefill).
        stats = (1 if arch.norm_offset else 2) * FP32
        norm = N * (a * d + (8 * d if a == FP32 else 8 * d + stats))
        if cache_prompt + held + norm > layer_attn:
            layer_attn, attn_cache = cache_prompt + held + norm, cache_prompt  # every k/v written by then
            attn_detail = "the last layer before its MLP"
    fresh, kept, kept_while = _head_bytes(b, V, sampling)
    logits = b * V * a  # the last position's only (logits_to_keep=1)
    phases = {"prefill": max(layer_mlp, layer_attn) + ids_prefill,
              "prefill sampling": cache_prompt + logits + fresh + ids_prefill}
    caches = {"prefill": cache_prompt if layer_mlp >= layer_attn else attn_cache,
              "prefill sampling": cache_prompt}
    update_detail = ""
    step_detail = " (the last layer's MLP)"
    if new_tokens > 1:
        # One token's tensors in the last layer while its cache grows: the embedding, the layer's
        # input and normed input, q and k after rope and v (Llama-style: rope's cos and sin too;
        # GPT-2: both embeddings and c_attn's fused output). In a one-layer Llama-style model the
        # layer's input is the embedding itself, as in the prefill (_held_bytes; counted apart,
        # a one-layer Gemma of width 96 was +1.1% over the measured generate).
        inputs = 3 if L > 1 else 2
        token = b * a * ((4 * d + qw + 2 * kvw) if gpt2 else (inputs * d + qw + 2 * kvw + 2 * hd))
        # The last step's update, and with a window the first one's too (the prompt's storage,
        # which can outgrow the window, is still held by the layers not yet updated).
        steps = {"": final_len - 1} if window is None else {" (first step)": s, "": final_len - 1}
        updates = {k: _update_bytes(b, kvw, a, s, c, windows) + _decode_ids(b, s, c) for k, c in steps.items()}
        update_detail = max(updates, key=lambda k: updates[k])
        phases["decode cache update"] = updates[update_detail] + kept + token
        phases["decode sampling"] = cache + logits + kept_while + fresh + _decode_ids(b, s, final_len - 1) + b * ID_BYTES
        # The last step's forward at its last layer's MLP, every layer's cache updated, beside the
        # previous step's sampling tensors: the prefill's MLP over one token a sequence, which
        # outgrows the cache update where the MLP is wide and the cache short (a small window).
        step_mlp = _held_bytes(arch, m, b, 1, a) + _mlp_bytes(arch, m, b, a)
        if arch.fused_proj:
            # Phi-3 holds its fused q/k/v output to the end of the attention: at o_proj the
            # embedding, the layer's input, the normed input, that output, q after rope (its cat),
            # SDPA's output (one position: the transpose's .contiguous() copies nothing), o_proj's
            # output and rope's cos and sin (left out, 4 one-token sequences at width 72 were
            # -1.2% under the measured generate).
            step_attn = b * a * ((inputs + 1) * d + (qw + 2 * kvw) + 2 * qw + 2 * hd)
            if step_attn > step_mlp:
                step_mlp, step_detail = step_attn, " (the last layer's o_proj)"
        phases["decode step"] = cache + kept + _decode_ids(b, s, final_len - 1) + step_mlp
        rope = 0 if gpt2 else kept + _decode_rope_bytes(b, a, s, (inputs * d, qw, kvw, hd), steps.values(), windows)
        if rope > phases["decode step"]:
            phases["decode step"], step_detail = rope, " (the last layer's rope)"
        caches["decode cache update"] = caches["decode sampling"] = caches["decode step"] = cache
    phase = max(phases, key=lambda k: phases[k])
    prefill_detail = "the last layer's MLP" if layer_mlp >= layer_attn else attn_detail
    details = {"prefill": f" ({prefill_detail})", "decode cache update": update_detail,
               "decode step": step_detail}
    return {
        "parameters": n_params,
        "weights_dtype": weights_dtype,
        "batch": b, "prompt_tokens": s, "new_tokens": new_tokens, "cache_positions": final_len,
        "cache_window": window, "cache_stored_positions": _stored(s, new_tokens, window),
        "sliding_layers": sum(w is not None for w in windows), "n_layers": L,
        "kv_width": kvw, "compute_bytes": a,
        "sampling": "temperature + top-k" if sampling else "greedy",
        "bytes": {"weights": weights, "kv_cache": cache, "activations": phases[phase] - caches[phase]},
        "kv_cache_at_peak": caches[phase],
        "phase_bytes": {k: weights + v for k, v in phases.items()},
        "peak_bytes": weights + phases[phase],
        "peak_phase": phase + details.get(phase, ""),
    }


def _held_bytes(arch: Arch, m: ModelConfig, b: int, s: int, a: int) -> int:
    """What a forward over ``b`` x ``s`` tokens holds across its layers (module docstring). GPT-2:
    wte's and wpe's outputs (GPT2Model's locals), the block's input (the caller's) and the attention
    output GPT2Block keeps until it returns. The others: the embedding output (the model's local
    until it returns), rope's cos and sin, and the layer's input (the caller's; the embedding
    itself in a one-layer model)."""
    N, d = b * s, m.d_model
    if arch.name == "gpt2":
        return 4 * N * d * a
    hd = arch.head_dim or m.head_dim
    return N * d * a + 2 * N * hd * a + (N * d * a if m.n_layers > 1 else 0)


def _mlp_bytes(arch: Arch, m: ModelConfig, tokens: int, a: int) -> int:
    """A layer's MLP over ``tokens`` tokens: the residual, the normed input and the MLP's
    intermediates (:func:`mlp_width_factor`)."""
    return tokens * a * (2 * m.d_model + mlp_width_factor(arch) * m.d_ff)


def _repeat_copies(qw: int, kvw: int, hd: int) -> bool:
    """Whether transformers' ``repeat_kv`` copies k and v to the query's width: under grouped heads,
    but not with one k/v head, whose ``expand(...).reshape(...)`` merges a size-1 dimension with the
    expanded one and so returns a view (counted as copies, a window's masked prefill was 2% to 14%
    over the measured generate)."""
    return qw != kvw and kvw != hd


def _stored(prompt: int, new_tokens: int, window: Optional[int]) -> int:
    """Positions a layer's cache stores at the end of generate: every one written (the last
    sampled token is never fed back), or with a ``window`` at most ``window`` from the first
    decode step on (the storage of a concatenation whose last ``window - 1`` positions it views)."""
    if new_tokens == 1:
        return prompt
    written = prompt + new_tokens - 1
    return written if window is None else min(written, window)


def _old_new_positions(prompt: int, cached: int, windows: Sequence[Optional[int]]) -> tuple[list[int], list[int]]:
    """Each layer's cache positions before and after the decode step that adds a position to
    ``cached`` ones (:func:`_update_bytes`' ``windows``)."""
    olds, news = [], []
    for w in windows:
        if w is None:
            olds.append(cached)
            news.append(cached + 1)
        else:
            olds.append(prompt if cached == prompt else min(cached, w))
            news.append(min(cached, w - 1) + 1)
    return olds, news


def _decode_rope_bytes(b: int, a: int, prompt: int, widths: tuple[int, int, int, int], steps: Iterable[int],
                       windows: Sequence[Optional[int]]) -> int:
    """A Llama-style decode step at its last layer's rope, before that layer's cache grows: the
    cache (:func:`_rope_cache_bytes`), the step's ids, and over one token a sequence the layer's
    inputs (``widths``: their width, q's, k's and v's, the head dim), q, k, v, rope's cos and sin,
    and q's three temporaries or k's beside q's result. ``steps``: the cached positions of the
    steps that can peak. Where the cache is short (one-token prompts) the update adds less than
    they weigh (left out, a two-layer one-head bf16 Llama of width 20 over one-token prompts was
    -1.17% to -1.47% under the measured generate)."""
    inputs, qw, kvw, hd = widths
    token = b * a * (inputs + qw + 2 * kvw + 2 * hd + max(3 * qw, qw + 3 * kvw))
    return token + max(_rope_cache_bytes(b, kvw, a, prompt, c, windows) + _decode_ids(b, prompt, c) for c in steps)


def _rope_cache_bytes(b: int, kvw: int, a: int, prompt: int, cached: int, windows: Sequence[Optional[int]]) -> int:
    """The KV cache's bytes while the last layer applies rope in the decode step after ``cached``
    positions: every layer before it updated, its own still old."""
    olds, news = _old_new_positions(prompt, cached, windows)
    return b * kvw * a * 2 * (sum(news[:-1]) + olds[-1])


def _update_bytes(b: int, kvw: int, a: int, prompt: int, cached: int, windows: Sequence[Optional[int]]) -> int:
    """The KV cache's bytes at their busiest during the decode step that adds a position to
    ``cached`` ones, ``windows`` giving each layer's window (None: a full-attention layer): every
    layer before the one updating holds its new tensors, every layer after it its old ones. A
    ``DynamicLayer`` lets its old key go before it concatenates the value (one old tensor beside
    its new ones); a ``DynamicSlidingWindowLayer`` concatenates both first (two), and its new
    tensors can be shorter than its old ones (a prompt longer than the window: the first sliding
    layer's update can be the peak then)."""
    olds, news = _old_new_positions(prompt, cached, windows)
    before, after = 0, 2 * sum(olds)  # the positions held by the layers before and after the one updating
    busiest = 0
    for w, old, new in zip(windows, olds, news):
        after -= 2 * old
        busiest = max(busiest, before + after + 2 * new + (1 if w is None else 2) * old)
        before += 2 * new
    return b * kvw * a * busiest


def _decode_ids(b: int, prompt: int, cached: int) -> int:
    """The int64 tensors of the decode step after ``cached`` positions: the ids and mask of
    ``cached + 1`` positions (the mask one longer once the step has run), three prompt-sized
    ones generate keeps (the prompt, its mask, its positions), and four of one entry a sequence:
    the step's input ids and positions (the model's copies), the previous step's sampled tokens
    and the unfinished-sequence flags (left out, 64 one-token prompts at width 16 were 2.6%
    under the measured generate)."""
    return 2 * b * (cached + 1) * ID_BYTES + 3 * b * prompt * ID_BYTES + 4 * b * ID_BYTES


def _head_bytes(b: int, V: int, sampling: bool) -> tuple[int, int, int]:
    """The sampling head's float32 (batch, vocab) tensors, in bytes: (made by one step at its
    busiest, kept from one step to the next, kept from the previous step while the next samples).

    Sampling: the float32 copy of the logits, the temperature's output, top-k's bool mask and its
    output (13 B a row entry); before the mask, beside the copy and the temperature's output,
    ``torch.topk``'s values (float32) and indices (int64) of ``min(TOP_K, V)`` entries a row, which
    outweigh the mask and its output where the vocabulary is under 2.4 x TOP_K (left out, vocabularies
    of 61 and 97 were 3% to 7% under the measured generate). The copy, the scores and the softmax
    live on (12 B) until the next step replaces them, the copy first (so 8 B beside the next
    step's). Greedy: the copy (argmax reads it in place)."""
    if sampling:
        top_k = b * min(TOP_K, V) * (FP32 + ID_BYTES)
        return max((3 * FP32 + 1) * b * V, 2 * FP32 * b * V + top_k), 3 * FP32 * b * V, 2 * FP32 * b * V
    return FP32 * b * V, FP32 * b * V, FP32 * b * V
