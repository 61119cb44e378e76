"""The workbench's kernels inside torchtitan's own models (Qwen3, Llama 3), and weights between the two.

`model.titan_model` builds torchtitan's own model from a workbench `ModelConfig` (`model.titan_args`);
`model.exact` routes its ops through the invariant kernels in the workbench's op order, so its training forward
gives the bits the workbench's generator samples with (`model.build_titan_model`: both, with the workbench's random
weights); `tp.apply_tp` shards the routed model over tensor-parallel ranks with the forward's bits kept (every
product column-parallel); `weights` moves state dicts and DCP checkpoints between torchtitan's names and the
workbench's. torchtitan is imported only by the modules of this package and by `rl.titan_backend` (the RL update on
torchtitan's components), so import them by name: `from workbench.titan.model import build_titan_model, exact`,
`from workbench.titan.tp import apply_tp`.
"""
