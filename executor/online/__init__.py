"""The online entry: an OpenAI-compatible server over the same engine core as the offline runs."""
