"""The partition schemes: every module here registers its draws with ``@register_scheme``
(fedcore/partition/registry.py), which imports them all on its first look-up."""
