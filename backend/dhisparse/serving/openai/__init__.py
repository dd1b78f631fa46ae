"""OpenAI-compatible API over the Triton deployment (`dhisparse-serve --openai-port N`); see docs/openai.md."""
