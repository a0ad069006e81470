// bsattn: block-sparse attention. Include this header for the whole public API.
#pragma once
#include "bsattn/backward.hpp"
#include "bsattn/distributed.hpp"
#include "bsattn/merge.hpp"
#include "bsattn/plan.hpp"
#include "bsattn/problem.hpp"
#include "bsattn/select.hpp"
#include "bsattn/selected.hpp"
#include "bsattn/summary.hpp"
#include "bsattn/tensor.hpp"
#include "bsattn/varlen.hpp"
