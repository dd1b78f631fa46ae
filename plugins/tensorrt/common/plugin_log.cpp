#include "plugin_log.h"

#include <atomic>
#include <cstdio>
#include <string>

namespace dhisparse
{
namespace trt
{
namespace
{
std::atomic<nvinfer1::ILoggerFinder*> g_logger_finder{nullptr};
} // namespace

void set_logger_finder(nvinfer1::ILoggerFinder* finder) noexcept
{
    g_logger_finder.store(finder);
}

void log_error(char const* plugin, char const* message) noexcept
{
    try
    {
        std::string const text = std::string("[dhisparse] ") + plugin + ": " + message;
        nvinfer1::ILoggerFinder* const finder = g_logger_finder.load();
        nvinfer1::ILogger* const logger = finder != nullptr ? finder->findLogger() : nullptr;
        if (logger != nullptr)
        {
            logger->log(nvinfer1::ILogger::Severity::kERROR, text.c_str());
        }
        else
        {
            std::fprintf(stderr, "%s\n", text.c_str());
        }
    }
    catch (...)
    {
        std::fprintf(stderr, "[dhisparse] %s: %s\n", plugin, message);
    }
}

} // namespace trt
} // namespace dhisparse
