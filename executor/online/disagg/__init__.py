"""Prefill-decode disaggregation (cann-recipes' online mode): role schedulers, the bootstrap server,
the KV transfer between a prefill and a decode instance, and the engine loop that joins them
(docs/online.md, "Prefill-decode disaggregation")."""
