"""Test support code (not collected by pytest: ``norecursedirs`` lists ``support``).

``mock_model_server``: a loopback HTTP/1.1 server speaking the Anthropic Messages SSE and
OpenAI chat-completions SSE wire formats, scriptable, with fault injection, for tests and
benchmarks.
"""
