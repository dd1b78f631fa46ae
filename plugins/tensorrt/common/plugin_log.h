// Error reporting of the plugin library through TensorRT's logger (set by setLoggerFinder at load time).
#pragma once

#include <NvInferRuntime.h>

namespace dhisparse
{
namespace trt
{

//! Remembers the logger finder TensorRT hands to the library (may be null).
void set_logger_finder(nvinfer1::ILoggerFinder* finder) noexcept;

//! Logs "[dhisparse] <plugin>: <message>" as an error to TensorRT's logger, or to stderr without one.
void log_error(char const* plugin, char const* message) noexcept;

} // namespace trt
} // namespace dhisparse
