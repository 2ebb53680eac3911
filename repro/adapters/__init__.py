"""One adapter per framework, behind `repro.adapters.base.Adapter`.

Framework libraries are imported inside their adapter's methods only, so that `repro --help`
stays fast and a missing framework is reported by name instead of breaking the whole kit.
"""
