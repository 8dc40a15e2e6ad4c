"""Grafana dashboards, generated with grafanalib from the fleet spec."""
