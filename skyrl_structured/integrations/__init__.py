"""Integrations with frameworks that drive the generator; each needs its framework installed.

- :mod:`skyrl_structured.integrations.skyrl`: SkyRL's trainer with ``StructuredGymGenerator``
  swapped in (``pip install 'skyrl-structured[skyrl]'``).
"""
