"""pageshare: share golden-image page-cache pages between VMs at read time."""

__version__ = "0.1.0"
