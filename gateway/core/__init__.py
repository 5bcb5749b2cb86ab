"""What every process of the gateway imports: configuration, errors, the OpenAI wire format, auth, HTTP helpers,
tracing, and what crosses between the serving and the store process. It imports nothing else of the gateway."""
