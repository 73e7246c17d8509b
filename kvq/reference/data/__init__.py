"""Data files shipped with kvq.reference: the HIGGS grids and the script that makes them."""
