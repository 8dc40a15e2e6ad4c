"""Prometheus rules and Alertmanager config, generated from the fleet spec."""
