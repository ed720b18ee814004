"""kvreplay's version, stated once: the package, its distribution metadata (pyproject.toml
reads it from here) and every manifest name it."""

VERSION = "0.1.0"
