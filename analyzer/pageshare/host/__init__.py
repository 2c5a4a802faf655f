"""The host tools: what a hypervisor runs, the pageshare-host package.

hostcheck (``pageshare host check``, with grubboot), attach (``pageshare
attach|detach``), libvirt_watch and libvirt_hook (with libvirt_config and
libvirt_qmp), over the one QMP client (qmp) and the one client of the page
server's control socket (server_control).  These modules import only each
other, the package's errors, and the standard library (python3-libvirt when
a libvirt domain is named): tests/deploy/test_host_package.py checks it.
"""
