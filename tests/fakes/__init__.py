"""Stand-ins for what cannot exist on a test machine (a GPU), faked at the library boundary."""
