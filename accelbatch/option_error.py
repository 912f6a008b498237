"""The error of an option whose value cannot work (its own module: the option checks and Opts both raise it)."""


class OptionError(ValueError):
    """An option has a value that cannot work; the message names the option and what to do."""


OptionError.__module__ = "accelbatch.opts"  # its public home (tracebacks and pickles name it there)
