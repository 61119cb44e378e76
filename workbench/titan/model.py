"""torchtitan's own Qwen3 and Llama 3 models with their ops routed through the workbench's kernels.

`exact(model, cfg)` keeps torchtitan's modules and parameters (so its `parallelize`, FSDP2, optimizer and checkpointer
see the model they built) and swaps the forwards, in place, for ones that call `workbench.kernels` in the workbench's
op order; the model gains the trainer's interface (`hidden_states`, `lm_head_weight`). The same kernels on the same
operands in the same order give the workbench's bits, forward and backward; where torchtitan's layout differs (Llama
3's interleaved q/k rows, w1/w3 beside the merged gate_up, the residual add in the block) only exact moves of data
stand between them. Apply `exact` before torchtitan's `parallelize`; tensor parallelism is `titan.tp.apply_tp`.
torchtitan's document masks and explicit `positions` are refused, not ignored. Each layout difference, and the order
of `exact`, FSDP2 and TP: docs/distributed.md, "`workbench/titan/model.py`: torchtitan's models on the workbench's
kernels".
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils.checkpoint import checkpoint

from ..kernels import (
    apply_rope,
    attention,
    embedding,
    get_mode,
    linear,
    norm_rope,
    rms_norm,
    rms_norm_add,
    rope_cos_sin,
    rope_inv_freq,
    silu_mul,
)
from ..models import RECOMPUTE, ModelConfig, build
from ..models.transformer import same_mode  # checkpoint's context_fn: recompute under the forward's mode
from .weights import qk_rows, to_titan


def titan_args(cfg: ModelConfig):
    """torchtitan's ModelArgs for `cfg`: Qwen3ModelArgs for the qwen3 family, Llama 3's TransformerModelArgs for
    llama and mistral; a one-line ValueError where torchtitan 0.2.2's models cannot express the config."""
    if cfg.attention_bias:
        raise ValueError(f"torchtitan 0.2.2 has no model with q/k/v biases ({cfg.model_type}); train this model "
                         "with the workbench's own trainer")
    if cfg.model_type == "qwen3":
        from torchtitan.models.qwen3.model.args import Qwen3ModelArgs

        if cfg.rope_scaling is not None:
            raise ValueError(f"torchtitan 0.2.2's Qwen3 has no RoPE scaling (cfg has {cfg.rope_scaling}); drop it "
                             "or train with the workbench's own trainer")
        return Qwen3ModelArgs(dim=cfg.hidden_size, n_layers=cfg.num_hidden_layers, n_heads=cfg.num_attention_heads,
                              n_kv_heads=cfg.num_key_value_heads, vocab_size=cfg.vocab_size, head_dim=cfg.head_dim,
                              hidden_dim=cfg.intermediate_size, norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                              qk_norm=cfg.qk_norm, max_seq_len=cfg.max_position_embeddings,
                              enable_weight_tying=cfg.tie_word_embeddings)
    if cfg.model_type not in ("llama", "mistral"):
        raise ValueError(f"torchtitan 0.2.2 has no {cfg.model_type} model; it runs qwen3, llama and mistral configs")
    from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs

    if cfg.qk_norm:
        raise ValueError("torchtitan 0.2.2's Llama 3 has no q/k norm; a config with qk_norm=True must be qwen3")
    if cfg.hidden_size != cfg.num_attention_heads * cfg.head_dim:
        raise ValueError(f"torchtitan's Llama 3 takes head_dim = hidden_size / heads = "
                         f"{cfg.hidden_size // cfg.num_attention_heads}, but cfg has head_dim {cfg.head_dim}")
    scaling = cfg.rope_scaling
    if scaling is not None and scaling.rope_type != "llama3":
        raise ValueError(f"torchtitan 0.2.2's Llama 3 has only llama3 RoPE scaling, not {scaling.rope_type!r}")
    # torchtitan applies its llama3 scaling always; factor 1 leaves the frequencies as they are (its own forward
    # only: the routed forward takes them from cfg).
    rope = (RoPEScalingArgs(scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor,
                            scaling.original_max_position_embeddings) if scaling else RoPEScalingArgs(1.0))
    # torchtitan derives the MLP width from dim: int(8 dim / 3), times ffn_dim_multiplier, rounded up to a multiple
    # of multiple_of. With multiple_of the width itself and the multiplier taking the product to at most the width,
    # the round-up lands on it exactly.
    width, derived = cfg.intermediate_size, int(2 * 4 * cfg.hidden_size / 3)
    return TransformerModelArgs(dim=cfg.hidden_size, n_layers=cfg.num_hidden_layers, n_heads=cfg.num_attention_heads,
                                n_kv_heads=cfg.num_key_value_heads, vocab_size=cfg.vocab_size, multiple_of=width,
                                ffn_dim_multiplier=None if derived <= width else width / derived,
                                norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, rope_scaling_args=rope,
                                max_seq_len=cfg.max_position_embeddings)


def _titan_class(cfg: ModelConfig) -> type[nn.Module]:
    if cfg.model_type == "qwen3":
        from torchtitan.models.qwen3.model.model import Qwen3Model

        return Qwen3Model
    from torchtitan.models.llama3.model.model import Transformer

    return Transformer


def titan_model(cfg: ModelConfig, device, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """torchtitan's own model for `cfg` (`titan_args`), not routed: built on the meta device, allocated in `dtype` on
    `device`, initialised by its own `init_weights`. A tied head in a Llama config is tied as torchtitan ties
    Qwen3's (`output.weight` is the embedding's tensor; its Llama 3 has no flag for it): tie it again after a
    `to_empty`, which allocates the two names apart."""
    with torch.device("meta"):
        model = _titan_class(cfg)(titan_args(cfg)).to(dtype)
    model = model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(device))
    if cfg.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model


def build_titan_model(cfg: ModelConfig, device, dtype: torch.dtype = torch.bfloat16,
                      seed: int | None = 0) -> nn.Module:
    """torchtitan's own model for `cfg` (`titan_model`), routed (`exact`).

    seed: the workbench's random weights of that seed (`models.build`: the same draws, mapped by
    `weights.to_titan`); None: torchtitan's own `init_weights`.
    """
    model = titan_model(cfg, device, dtype)
    if seed is not None:
        model.load_state_dict(to_titan(build(cfg, device=device, dtype=dtype, seed=seed).state_dict(), cfg))
    return exact(model, cfg)


class _HalvesRows(torch.autograd.Function):
    """A Llama 3 q/k weight in the workbench's halves layout (`weights.qk_rows`), for the product to run on
    (docs/distributed.md, `workbench/titan/model.py`). Its gradient goes back to the parameter in torchtitan's rows: a bf16 gradient (no `main_grad`) is
    scattered; where the parameter carries an fp32 `main_grad`, the gathered weight carries its own, a -0.0 buffer
    the linear kernel adds dW into (returning no gradient), and the backward adds that buffer into the parameter's.
    The backward runs although the product returns None for the weight (autograd calls a node whose incoming
    gradient is undefined; with materialised gradients off it is None here), on the device thread of its forward's
    output (torch 2.13's engine picks the thread by a node's metadata, not its gradients) and, created after the
    block's input norm (a thread runs its ready nodes latest-created first), before the norm's backward, so before
    FSDP2's post-backward reduces the block's gradients (tests/test_titan_backend.py checks them on CPU)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, head_dim: int) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        ctx.param, ctx.head_dim = weight, head_dim
        out = qk_rows(weight, head_dim, to_interleaved=False)
        ctx.buffer = None
        if ctx.needs_input_grad[0] and getattr(weight, "main_grad", None) is not None:
            ctx.buffer = out.main_grad = torch.full(out.shape, -0.0, dtype=torch.float32, device=out.device)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if ctx.buffer is not None:
            main_grad = getattr(ctx.param, "main_grad", None)
            if main_grad is None:
                raise RuntimeError("the q/k weight lost its main_grad between the forward and the backward; set "
                                   "main_grads before the forward (TrainWeights.zero_grad)")
            main_grad.add_(qk_rows(ctx.buffer, ctx.head_dim, to_interleaved=True))
        return None if grad is None else qk_rows(grad, ctx.head_dim, to_interleaved=True), None


class _Linear:
    halves = 0
    """Llama 3's wq/wk: the head dim by which the product takes the interleaved rows in the workbench's halves layout
    (`_HalvesRows`; docs/distributed.md); 0: the rows as stored."""

    def forward(self, x):
        weight = _replicated(self.weight)
        if isinstance(weight, DTensor):
            return _sharded_linear(x, weight, self.halves)
        if self.halves:
            weight = _HalvesRows.apply(weight, self.halves)
        return linear(x, weight, self.bias)


def _replicated(weight: torch.Tensor) -> torch.Tensor:
    """A weight replicated over the tensor-parallel ranks (`titan.tp`: each rank holds it whole and computes its
    whole gradient, so the gradient is Replicate too) as the plain tensor the kernels take; any other as it is."""
    if isinstance(weight, DTensor) and all(p.is_replicate() for p in weight.placements):
        return _local(weight)
    return weight


def _local(weight: DTensor) -> torch.Tensor:
    """This rank's part of a tensor-parallel weight, carrying this rank's part of the weight's fp32 `main_grad`
    (a DTensor laid out as the weight, or its local tensor) for the kernels that add dW into it (linear, embedding)."""
    local = weight.to_local()
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is not None:
        local.main_grad = main_grad.to_local() if isinstance(main_grad, DTensor) else main_grad
    return local


def _sharded_linear(x: DTensor, weight: DTensor, halves: int) -> DTensor:
    """The product on this rank's shard of a tensor-parallel weight (`titan.tp`), as the DTensor its style's output
    hook lays out. A weight sharded by rows (column-parallel) gives this rank's output features, each element the
    one-process product's bits (its row of x, its row of W, the same K loop); dx is this rank's partial sum over its
    features, marked Partial so that the input hook's backward sums the ranks'. A weight sharded by columns
    (row-parallel: torchtitan's wo/w2, the tests' negative control) gives y as a partial sum over K."""
    colwise = weight.placements[0].is_shard(0)
    local = _local(weight)
    if halves:   # a shard holds whole heads, so the per-head permutation applies to it as to the whole weight
        local = _HalvesRows.apply(local, halves)
    y = linear(x.to_local(grad_placements=[Partial()] if colwise else None), local)
    return DTensor.from_local(y, x.device_mesh, [Shard(-1) if colwise else Partial()], run_check=False)


class _RMSNorm:
    def forward(self, x):
        return rms_norm(x, _replicated(self.weight), self.eps)

    def add(self, x, residual):
        """(norm(x + residual), x + residual) in one pass (`kernels.rms_norm_add`)."""
        return rms_norm_add(x, residual, _replicated(self.weight), self.eps)


class _FeedForward:
    def forward(self, x):
        return self.w2(silu_mul(self.w1(x), self.w3(x)))


class _Attention:
    def forward(self, x, cos, sin, seq_lens):
        b, t, _ = x.shape                                                     # x [B, T, H]
        q, k = self.wq(x), self.wk(x)   # Llama 3: the workbench's q_proj and k_proj rows (`_Linear.halves`)
        q = q.view(b, t, -1, self.head_dim)                                   # [B, T, Hq, D] (Hq local under TP)
        k = k.view(b, t, -1, self.head_dim)                                   # [B, T, Hkv, D]
        v = self.wv(x).view(b, t, -1, self.head_dim)
        qk_norm = getattr(self, "q_norm", None) is not None
        fuses = get_mode("apply_rope") == "invariant" and (not qk_norm or get_mode("rms_norm") == "invariant")
        if qk_norm:
            qw, kw = self._head_norm_weight(self.q_norm), self._head_norm_weight(self.k_norm)
        if qk_norm and torch.is_grad_enabled() and fuses:  # the workbench's training forward: one pass each way
            q = norm_rope(q, qw, cos, sin, self.q_norm.eps)
            k = norm_rope(k, kw, cos, sin, self.k_norm.eps)
        else:
            if qk_norm:
                q, k = rms_norm(q, qw, self.q_norm.eps), rms_norm(k, kw, self.k_norm.eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)          # cos, sin [B, T, D/2]
        o = attention(q, k, v, seq_lens)                                      # [B, T, Hq, D]
        return self.wo(o.reshape(b, t, -1))                                   # [B, T, H]

    def _head_norm_weight(self, norm: nn.Module) -> torch.Tensor:
        """q/k norm's weight. Under tensor parallelism (wq sharded, `titan.tp`) each rank norms its own heads with
        the replicated weight, so its gradient here is this rank's partial sum: marked Partial, the ranks' are
        summed in the backward (as torchtitan's SequenceParallel q/k norm sums them)."""
        weight, mesh = _replicated(norm.weight), getattr(self.wq.weight, "device_mesh", None)
        if mesh is None:
            return weight
        return DTensor.from_local(weight, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


class _Block:
    def forward(self, x, residual, cos, sin, seq_lens, recompute_mlp=False):
        """(sub-layer output, residual stream) -> the same pair one layer on; layer 0 gets residual None."""
        if residual is None:
            h, residual = self.attention_norm(x), x
        else:
            h, residual = self.attention_norm.add(x, residual)
        x = self.attention(h, cos, sin, seq_lens)
        h, residual = self.ffn_norm.add(x, residual)
        if recompute_mlp:
            return checkpoint(self.feed_forward, h, use_reentrant=False, context_fn=same_mode()), residual
        return self.feed_forward(h), residual


class _Model:
    config: ModelConfig
    """The workbench config the routed forward takes RoPE from (set by `exact`)."""

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The embedding where cfg ties the head, as the workbench's model: a `to_empty` (torchtitan's trainer
        allocates after `parallelize`) unties torchtitan's Llama 3, whose `init_weights` does not tie again."""
        return _replicated(self.tok_embeddings.weight if self.config.tie_word_embeddings else self.output.weight)

    def hidden_states(self, input_ids, seq_lens=None, recompute: str = "none"):
        """Final-norm hidden states [B, T, H] of a right-padded batch (row b has seq_lens[b] real tokens, default
        all); `recompute` as in `workbench.models.CausalLM.hidden_states`."""
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
        b, t = input_ids.shape                                                # input_ids [B, T]
        dev = input_ids.device
        if seq_lens is None:
            seq_lens = torch.full((b,), t, device=dev, dtype=torch.int32)
        cfg = self.config
        scaling = cfg.rope_scaling.to_hf() if cfg.rope_scaling else None
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, scaling, device=dev)
        cos, sin = rope_cos_sin(torch.arange(t, device=dev).expand(b, t), inv_freq)  # [B, T, D/2] fp32
        x, residual = embedding(input_ids, _replicated(self.tok_embeddings.weight)), None  # [B, T, H]
        grad = torch.is_grad_enabled()
        for layer in self.layers.values():
            if recompute == "layers" and grad:
                x, residual = checkpoint(layer, x, residual, cos, sin, seq_lens, use_reentrant=False,
                                         context_fn=same_mode())
            else:
                x, residual = layer(x, residual, cos, sin, seq_lens, recompute_mlp=recompute == "mlp" and grad)
        return self.norm.add(x, residual)[0]

    def forward(self, tokens, attention_masks=None, positions=None):
        """Logits [B, T, V] of full-length causal rows (torchtitan's trainer's call)."""
        if attention_masks is not None or positions is not None:
            raise ValueError("the exact forward runs causal rows from position 0: torchtitan's attention_masks and "
                             "positions (flex/varlen document masking) are not supported; use attn_type 'sdpa'")
        return linear(self.hidden_states(tokens), self.lm_head_weight)


_SUBCLASSES: dict[tuple[type, type], type] = {}


def _route(module: nn.Module, routed: type, **attrs) -> None:
    """Give `module` a subclass of its own class with `routed`'s methods first (its parameters stay)."""
    cls = type(module)
    if not issubclass(cls, routed):
        if (routed, cls) not in _SUBCLASSES:
            _SUBCLASSES[routed, cls] = type(f"Exact{cls.__name__}", (routed, cls), {})
        module.__class__ = _SUBCLASSES[routed, cls]
    for k, v in attrs.items():
        setattr(module, k, v)


def _check(model: nn.Module, cfg: ModelConfig) -> None:
    want = _titan_class(cfg)
    if not isinstance(model, want):
        raise TypeError(f"exact: a {cfg.model_type} config routes torchtitan's {want.__name__}, got "
                        f"{type(model).__name__}")
    with torch.device("meta"):
        names = to_titan(build(cfg, device="meta", seed=None).state_dict(), cfg)
    have = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for name, t in names.items():
        if have.get(name) != tuple(t.shape):
            raise ValueError(f"exact: the model's {name} has shape {have.get(name)}, cfg gives {tuple(t.shape)}; "
                             "build the model from this config (titan_args)")
    extra = sorted(set(have) - set(names))
    if extra:
        raise ValueError(f"exact: the model has parameters the workbench's model has not: {extra[:3]}")
    if cfg.tie_word_embeddings != (model.output.weight is model.tok_embeddings.weight):
        raise ValueError(f"exact: cfg.tie_word_embeddings is {cfg.tie_word_embeddings} but the model's output "
                         "weight is " + ("" if cfg.tie_word_embeddings else "not ") + "its own tensor; tie them "
                         "(model.output.weight = model.tok_embeddings.weight) or fix the config")
    eps = {m.eps for m in model.modules() if isinstance(m, nn.RMSNorm)}
    if eps != {cfg.rms_norm_eps}:
        raise ValueError(f"exact: the model's RMSNorm eps {sorted(eps, key=str)} differ from cfg's {cfg.rms_norm_eps}")


def exact(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    """Route torchtitan `model`'s ops through the workbench's kernels, in place (see the module docstring);
    returns the model. `cfg` is the workbench config it was built from (`titan_args(cfg)`)."""
    _check(model, cfg)
    for m in model.modules():
        if isinstance(m, nn.Linear):
            _route(m, _Linear)
        elif isinstance(m, nn.RMSNorm):
            _route(m, _RMSNorm)
    for block in model.layers.values():
        _route(block, _Block)
        _route(block.attention, _Attention)
        _route(block.feed_forward, _FeedForward)
        if cfg.model_type != "qwen3":   # Llama 3's interleaved q/k rows
            block.attention.wq.halves = block.attention.wk.halves = cfg.head_dim
    _route(model, _Model, config=cfg)
    return model
