"""Sector lists: the "pcsl v1" format, the ``pageshare list`` commands, Redis, refinement.

sectorlist reads and writes the format (lists/README.md); listcli is
``pageshare list show|verify|refine``; distribute moves lists and the page
servers' status through Redis (``list publish|fetch|ls``, ``fleet``);
feedback reads the servers' read summaries, refine makes the next list
generation from them, and fileblocks says which disk blocks are one whole
page of a regular file.
"""
