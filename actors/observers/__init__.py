"""Observers a host can attach to watch its sessions (OpenTelemetry export)."""
