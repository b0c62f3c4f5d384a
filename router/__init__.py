"""The front door: routes OpenAI requests to vLLM instances by what the index knows, load,
and what each tier costs (docs/router.md)."""
