"""Outbound network for inferlets: the operator's allowlist and the HTTP client the `http` import uses."""
