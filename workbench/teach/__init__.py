"""Views that teach: the token-level mismatch viewer (`mismatch_view`) over the long table of `token_table`."""
