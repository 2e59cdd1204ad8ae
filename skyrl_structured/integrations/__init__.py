"""Integrations with frameworks that drive the generator; each needs its framework installed.

- :mod:`skyrl_structured.integrations.skyrl`: SkyRL's trainer with ``StructuredGymGenerator``
  swapped in (SkyRL with its trainer: ``pip install 'skyrl[fsdp]'``, Python 3.12 or newer).
"""
