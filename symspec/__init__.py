from . import groups
