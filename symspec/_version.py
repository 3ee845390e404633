"""symspec's version, on the base floor: the modules below the facade read it from here."""

__version__ = "0.1.0"
