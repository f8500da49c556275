"""Observability: the admin HTTP endpoint, Prometheus metrics, the cluster status and the timeline."""
