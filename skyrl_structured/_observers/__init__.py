"""The observers shipped beside the API in :mod:`skyrl_structured.observe`.

The trace recorder, the OpenTelemetry observer and the Prometheus observer.
"""
