"""Engines: what generates tokens behind the gateway (local transformers or an upstream server)."""
