"""tq's version, in a module of its own so that no module below the package face has to
import the face (which lazily reaches every workflow) to learn it."""

__version__ = "0.1.0"
