"""What the workbench shows and explains, above the library: the first demo (`demo`: does a row of a matmul depend
on its batch?), the parity audit (`audit`: every registry op, then the model op by op), generator vs trainer on one
prompt (`compare`), the notebooks' explorers (`widgets`), and the token-level mismatch viewer (`mismatch_view`)
over the long table of `token_table`."""
