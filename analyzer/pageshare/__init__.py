"""pageshare: share golden-image page-cache pages between VMs at read time."""

__version__ = "0.2.0"
