"""Model providers: one adapter per wire protocol (Anthropic Messages, OpenAI Chat
Completions, OpenAI Responses) and the in-process scripted model, listed in ``registry``."""
