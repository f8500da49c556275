"""gradwire's version, in one place below the package face (gradwire-native must match it exactly)."""

VERSION = "0.1.0"
