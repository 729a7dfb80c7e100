"""Chat formatting for Gemma 4: render messages + tools through the checkpoint's own template,
and turn the model's raw reply back into OpenAI fields (content, reasoning, tool_calls)."""
