"""``kvtier route``: an OpenAI-compatible front over several ``kvtier serve`` instances that sends
each request where its prompt's prefix is cached (KV events in, expected prefill time out)."""
