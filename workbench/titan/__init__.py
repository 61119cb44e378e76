"""The workbench's kernels inside torchtitan's own models (Qwen3, Llama 3), and weights between the two.

`model.build_titan_model` builds torchtitan's model from a workbench `ModelConfig`; `model.exact` routes its ops
through the invariant kernels in the workbench's op order, so its training forward gives the bits the workbench's
generator samples with; `weights` moves state dicts and DCP checkpoints between torchtitan's names and the
workbench's. torchtitan is imported only by the modules of this package (the rest of the workbench never does),
so import them by name: `from workbench.titan.model import build_titan_model, exact`.
"""
