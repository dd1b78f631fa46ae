// Entry points of libdhisparse_trt_plugins.so, found by IPluginRegistry::loadLibrary (trtexec
// --dynamicPlugins, tensorrt.get_plugin_registry().load_library(path)).
#include "common/plugin_log.h"
#include "resolver/ResolverPlugin.h"
#include "row_copy/RowCopyPlugin.h"
#include "sparse_mla/SparseMlaPlugin.h"

#include <NvInferRuntime.h>

namespace
{

nvinfer1::IPluginCreatorInterface* const* creators(int32_t& count)
{
    static dhisparse::trt::PluginCreator<dhisparse::trt::ResolverPlugin> resolver;
    static dhisparse::trt::PluginCreator<dhisparse::trt::RowCopyPlugin> row_copy;
    static dhisparse::trt::PluginCreator<dhisparse::trt::SparseMlaPlugin> sparse_mla;
    static nvinfer1::IPluginCreatorInterface* const list[] = {&resolver, &row_copy, &sparse_mla};
    count = static_cast<int32_t>(sizeof(list) / sizeof(list[0]));
    return list;
}

} // namespace

#define DHS_EXPORT __attribute__((visibility("default")))

extern "C" {

//! Required by IPluginRegistry::loadLibrary: where plugins find TensorRT's logger.
DHS_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder)
{
    dhisparse::trt::set_logger_finder(finder);
}

//! IPluginV3 creators of this library (TensorRT >= 10 looks for this symbol first).
DHS_EXPORT nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    return creators(nbCreators);
}

} // extern "C"
