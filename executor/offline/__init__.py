"""The offline entry point: a YAML and a prompt list in, generated text and timings out."""
