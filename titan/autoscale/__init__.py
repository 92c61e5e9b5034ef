"""Autoscaling simulator: Kubernetes' HPA algorithm against a simulated fleet of Titan replicas."""
