"""`miles serve`: the built-in engine behind SGLang's HTTP protocol (and OpenAI's completions)."""
