"""The private parts of the ``skyrl-structured`` command (see :mod:`skyrl_structured.cli`)."""
