"""The coordinator: registry, HTTP API."""
